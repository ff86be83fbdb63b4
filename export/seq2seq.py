"""Encoder-decoder graphs (T5, Flan-T5, mT5, UMT5, BART, Marian, mBART, Pegasus): an encoder graph run once per request, and decoder
graphs over the same preallocated, in-place self-attention KV as the decoder-only ones.

    encoder   input_ids int64 [1, N]  (N: source tokens, dynamic)
              -> cross_key_i / cross_value_i [1, H, N, D] per *decoder* layer i: the
                 encoder output already projected by layer i's cross-attention K/V
    decoder   input_ids, position_ids [1, S]; seqlens_k, total_sequence_length; past_key_i /
              past_value_i [1, H, MAX, D] (bound to the cache, written in place, as graphs.py);
              cross_key_i / cross_value_i [1, H, N, D] (the encoder's outputs, bound as they are:
              never copied per call) -> logits [1, S, V], present_key_i / present_value_i

Self-attention is ORT's GroupQueryAttention (kv heads = heads). T5 adds a relative position
bias to the scores, which GroupQueryAttention takes as ``attention_bias`` [1, H, S, T]; the
graph computes it for the MAX buffer rows from ``position_ids`` and the op's translation
slices it to the call's T rows. Cross-attention is ORT's MultiHeadAttention over the bound K/V,
in the encoder's layout. With --max-batch, a rows graph per model (``export_seq2seq_batched``):
B rows of the decoder, each over its own KV slot and its own source's cross K/V
(``cross_key_i_b`` [1, H, source_b, D]), merged across row counts by export/rows.py.

Each family is one ``Seq2SeqFamily`` entry: how to build its decoder module and where its
cross-attention K/V projections are. The differences (T5: pre-RMSNorm, no attention scale,
relative bias, tied head scaled by d_model^-0.5; BART/Marian: post-LayerNorm, learned or
sinusoidal positions, embedding scale, final_logits_bias) live in those modules, at export time.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import onnx
import onnxscript
import torch
from onnx.defs import OpSchema
from onnxscript import opset18 as op

from specdec.export import attention, versions
from specdec.export.graphs import TORCH_DTYPES, signature
from specdec.manifest import GraphIO, TensorSpec


@attention.gqa_op("gqa_bias", "Tensor bias, SymInt num_heads, float scale")
def gqa_bias(query, key, value, past_key, past_value, seqlens_k, total_len, bias, num_heads, scale):
    """``specdec::gqa`` with an additive score bias [1, H, S, MAX] (rows [0, total) are used)."""
    return attention.reference_attention(query, key, value, past_key, past_value, total_len, num_heads, num_heads, scale, bias=bias)


_MSFT = onnxscript.values.Opset("com.microsoft", 1)


def _gqa_bias_to_onnx(query, key, value, past_key, past_value, seqlens_k, total_len, bias, num_heads: int, scale: float):
    total = op.Reshape(op.Cast(total_len, to=7), op.Constant(value_ints=[1]))  # 7: INT64
    rows = op.Slice(bias, op.Constant(value_ints=[0]), total, op.Constant(value_ints=[3]))  # [1, H, S, T]
    return _MSFT.GroupQueryAttention(
        query, key, value, past_key, past_value, seqlens_k, total_len, None, None, None, rows,
        num_heads=num_heads, kv_num_heads=num_heads, scale=scale, local_window_size=-1,
    )  # fmt: skip


def _register_mha_schema() -> None:
    """ORT's MultiHeadAttention as far as the cross-attention uses it (query, key, value), for
    onnxscript to emit (the onnx package knows no contrib ops; attention.py does the same for GQA)."""
    if onnx.defs.has("MultiHeadAttention", "com.microsoft"):
        return
    formal, attr, kind = OpSchema.FormalParameter, OpSchema.Attribute, OpSchema.AttrType
    onnx.defs.register_schema(
        OpSchema("MultiHeadAttention", "com.microsoft", 1, inputs=[formal("query", "T"), formal("key", "T"), formal("value", "T")],
                 outputs=[formal("output", "T")], type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "")],
                 attributes=[attr("num_heads", kind.INT, ""), attr("scale", kind.FLOAT, "")])  # fmt: skip
    )


_register_mha_schema()


@torch.library.custom_op("specdec::cross_attention", mutates_args=())
def cross_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, num_heads: int, scale: float) -> torch.Tensor:
    """q [1, S, H*D] over the encoder's K/V [1, H, N, D], every source row visible -> [1, S, H*D]."""
    weights = (_heads(query, num_heads) @ key.transpose(-1, -2)) * scale  # [1, H, S, N]
    out = weights.softmax(-1) @ value  # [1, H, S, D]
    return out.transpose(1, 2).reshape(query.shape[0], query.shape[1], -1)


@cross_attention_op.register_fake
def _cross_attention_fake(query, key, value, num_heads, scale):
    return torch.empty_like(query)


def _cross_attention_to_onnx(query, key, value, num_heads: int, scale: float):
    """ORT's MultiHeadAttention, which reads K/V in the encoder's [1, H, N, D] layout as they are:
    no Transpose or Reshape around it (ORT's own fusion of the MatMul/Softmax form left ~8 a row
    and layer, the larger part of a rows graph's cross-attention time on the demo pair)."""
    return _MSFT.MultiHeadAttention(query, key, value, num_heads=num_heads, scale=scale)


TRANSLATION = {**attention.CUSTOM_TRANSLATION, torch.ops.specdec.gqa_bias.default: _gqa_bias_to_onnx,
               torch.ops.specdec.cross_attention.default: _cross_attention_to_onnx}  # fmt: skip


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[1, N, H*D] -> [1, H, N, D]."""
    return x.view(x.shape[0], x.shape[1], heads, -1).transpose(1, 2)


def cross_attention(q: torch.Tensor, key, value, heads: int, scale: float) -> torch.Tensor:
    """q [1, S, H*D] over the encoder's K/V [1, H, N, D] (every source row visible) -> [1, S, H*D].
    Rows (``key``/``value`` lists of B): q [B, S, H*D], row b over its own source's K/V [1, H, N_b, D]."""
    if isinstance(key, list):
        return torch.cat([cross_attention(qb, k, v, heads, scale) for qb, k, v in zip(q.split(1), key, value)])
    return torch.ops.specdec.cross_attention(q, key, value, heads, float(scale))


def self_attention(q, k, v, past_k, past_v, seqlens, total, heads: int, scale: float, bias=None):
    """New rows' q/k/v [1, S, H*D] over the cache buffer -> output [1, S, H*D], present K, present V.
    Rows (``past_k``/``past_v``/``total`` lists of B, seqlens [B], bias [B, H, S, MAX]): q/k/v
    [B, S, H*D], one batch-1 attention per row over its own buffers (export/batched.py: ORT's CPU
    GroupQueryAttention takes no batch of several new tokens over a past) -> [B, S, H*D], lists of B."""
    if isinstance(past_k, list):  # each tensor split once (one Split node), not sliced per row: fewer ops a call
        n = len(past_k)
        biases = [None] * n if bias is None else bias.split(1)
        rows = [self_attention(*qkv, past_k[b], past_v[b], seqlens[b : b + 1], total[b], heads, scale, biases[b])
                for b, qkv in enumerate(zip(q.split(1), k.split(1), v.split(1)))]  # fmt: skip
        out, pk, pv = zip(*rows)
        return torch.cat(out), list(pk), list(pv)
    if bias is None:
        return torch.ops.specdec.gqa(q, k, v, past_k, past_v, seqlens, total, heads, heads, scale, 0)
    return torch.ops.specdec.gqa_bias(q, k, v, past_k, past_v, seqlens, total, bias, heads, scale)


def t5_scales_head(cfg) -> bool:
    """Whether T5's head input is scaled by d_model^-0.5: original T5 (tied head) yes, v1.1 and
    flan-t5 (own head) no. transformers 5.x says so in ``scale_decoder_outputs`` (it sets
    ``tie_word_embeddings`` True for every T5 and unties on load when the checkpoint holds its
    own head); 4.57 in ``tie_word_embeddings``. mT5 on 5.x never scales (its config reads tied
    whatever the checkpoint; real mT5 checkpoints have their own head, unscaled on 4.57 too)."""
    if hasattr(cfg, "scale_decoder_outputs"):
        return bool(cfg.scale_decoder_outputs)
    if getattr(cfg, "model_type", None) == "mt5" and versions.installed() >= (5, 0):
        return False
    return bool(cfg.tie_word_embeddings)


class T5Decoder(torch.nn.Module):
    """T5's (Flan-T5's, mT5's) decoder stack and head: pre-RMSNorm blocks, unscaled attention,
    the relative position bias of block 0 shared by every block (UMT5: each block's own), and a
    tied head scaled by d_model^-0.5."""

    def __init__(self, model, max_seq: int):
        super().__init__()
        cfg = model.config
        self.dec, self.lm_head, self.heads, self.max_seq = model.get_decoder(), model.lm_head, cfg.num_heads, max_seq
        self.out_scale = cfg.d_model**-0.5 if t5_scales_head(cfg) else 1.0
        attn = [b.layer[0].SelfAttention for b in self.dec.block]
        self.own_bias = [getattr(a, "has_relative_attention_bias", False) for a in attn]  # T5: block 0 only; UMT5: every block
        self.attn = attn

    def position_bias(self, attn, position_ids: torch.Tensor) -> torch.Tensor:
        """[B, H, S, MAX]: ``attn``'s bias of row b's query position i for key row j (rows past i are masked anyway)."""
        rel = torch.arange(self.max_seq, device=position_ids.device)[None, None, :] - position_ids[:, :, None]  # [B, S, MAX]
        bucket = attn._relative_position_bucket
        if "bidirectional" in inspect.signature(bucket).parameters:  # T5's and mT5's: a static method given the table's shape
            buckets = bucket(rel, bidirectional=False, num_buckets=attn.relative_attention_num_buckets, max_distance=attn.relative_attention_max_distance)
        else:  # UMT5's reads them off the layer (a decoder's: one direction)
            buckets = bucket(rel)
        return attn.relative_attention_bias(buckets).permute(0, 3, 1, 2)  # [B, S, MAX, H] -> [B, H, S, MAX]

    def forward(self, input_ids, position_ids, seqlens, total, past, cross):
        h = self.dec.embed_tokens(input_ids)
        presents = []
        for i, block in enumerate(self.dec.block):
            if self.own_bias[i]:
                bias = self.position_bias(self.attn[i], position_ids)
            sa_layer, ca_layer, ff = block.layer
            sa, x = sa_layer.SelfAttention, sa_layer.layer_norm(h)
            out, pk, pv = self_attention(sa.q(x), sa.k(x), sa.v(x), past[2 * i], past[2 * i + 1], seqlens, total, self.heads, 1.0, bias)
            h = h + sa.o(out)
            ca = ca_layer.EncDecAttention
            h = h + ca.o(cross_attention(ca.q(ca_layer.layer_norm(h)), cross[2 * i], cross[2 * i + 1], self.heads, 1.0))
            h = ff(h)
            presents += [pk, pv]
        h = self.dec.final_layer_norm(h) * self.out_scale
        return self.lm_head(h), presents


class BartDecoder(torch.nn.Module):
    """BART's and Marian's decoder stack and head: post-LayerNorm blocks, learned (BART, offset 2)
    or sinusoidal (Marian) positions, the embedding scale, final_logits_bias. With ``pre_norm``,
    mBART's and Pegasus's: LayerNorm before each sublayer, and the stack's own after the last."""

    def __init__(self, model, max_seq: int, pre_norm: bool = False):
        super().__init__()
        cfg = model.config
        self.pre_norm = pre_norm
        self.dec, self.lm_head, self.heads = model.get_decoder(), model.lm_head, cfg.decoder_attention_heads
        self.scale = (cfg.d_model // self.heads) ** -0.5
        self.offset = getattr(self.dec.embed_positions, "offset", 0)
        # BART's embed_tokens scales inside (BartScaledWordEmbedding); Marian's decoder scales after it
        self.embed_scale = 1.0 if hasattr(self.dec.embed_tokens, "embed_scale") else getattr(self.dec, "embed_scale", 1.0)
        self.logits_bias = getattr(model, "final_logits_bias", None)

    def forward(self, input_ids, position_ids, seqlens, total, past, cross):
        dec = self.dec
        h = dec.embed_tokens(input_ids) * self.embed_scale + dec.embed_positions.weight[position_ids + self.offset]
        if getattr(dec, "layernorm_embedding", None) is not None:
            h = dec.layernorm_embedding(h)
        presents = []
        for i, layer in enumerate(dec.layers):
            sa, ca = layer.self_attn, layer.encoder_attn
            h, (pk, pv) = self.sublayer(h, layer.self_attn_layer_norm, lambda x: self.attend(sa, x, past[2 * i], past[2 * i + 1], seqlens, total))
            h, _ = self.sublayer(h, layer.encoder_attn_layer_norm,
                                 lambda x: (ca.out_proj(cross_attention(ca.q_proj(x), cross[2 * i], cross[2 * i + 1], self.heads, self.scale)), None))  # fmt: skip
            h, _ = self.sublayer(h, layer.final_layer_norm, lambda x: (layer.fc2(layer.activation_fn(layer.fc1(x))), None))
            presents += [pk, pv]
        if self.pre_norm:
            h = dec.layer_norm(h)
        logits = self.lm_head(h)
        return (logits + self.logits_bias if self.logits_bias is not None else logits), presents


    def sublayer(self, h, norm, f):
        """A residual sublayer: ``norm`` before ``f`` (pre-norm) or after the sum (post-norm);
        ``f`` returns (output, extra)."""
        out, extra = f(norm(h) if self.pre_norm else h)
        return (h + out if self.pre_norm else norm(h + out)), extra

    def attend(self, sa, x, past_k, past_v, seqlens, total):
        out, pk, pv = self_attention(sa.q_proj(x), sa.k_proj(x), sa.v_proj(x), past_k, past_v, seqlens, total, self.heads, self.scale)
        return sa.out_proj(out), (pk, pv)


@dataclass(frozen=True)
class Seq2SeqFamily:
    decoder: Callable[[torch.nn.Module, int], torch.nn.Module]  # (model, MAX) -> module(ids, pos, seqlens, total, past, cross)
    cross_proj: Callable[[torch.nn.Module], list[tuple[torch.nn.Module, torch.nn.Module]]]  # per decoder layer: (K, V) projections


SEQ2SEQ = {
    "t5": Seq2SeqFamily(T5Decoder, lambda m: [(b.layer[1].EncDecAttention.k, b.layer[1].EncDecAttention.v) for b in m.get_decoder().block]),
    "bart": Seq2SeqFamily(BartDecoder, lambda m: [(layer.encoder_attn.k_proj, layer.encoder_attn.v_proj) for layer in m.get_decoder().layers]),
    "mbart": Seq2SeqFamily(functools.partial(BartDecoder, pre_norm=True),
                           lambda m: [(layer.encoder_attn.k_proj, layer.encoder_attn.v_proj) for layer in m.get_decoder().layers]),
}


class _Encoder(torch.nn.Module):
    def __init__(self, model, family: str, heads: int):
        super().__init__()
        self.encoder, self.heads = model.get_encoder(), heads
        self.proj = torch.nn.ModuleList(torch.nn.ModuleList(kv) for kv in SEQ2SEQ[family].cross_proj(model))

    def forward(self, input_ids, attention_mask=None):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [B, N, d_model]
        return tuple(_heads(p(h), self.heads) for kv in self.proj for p in kv)


class _Decoder(torch.nn.Module):
    def __init__(self, model, family: str, max_seq: int):
        super().__init__()
        self.body = SEQ2SEQ[family].decoder(model, max_seq)

    def forward(self, input_ids, position_ids, scalars, past, cross):
        logits, presents = self.body(input_ids, position_ids, scalars[0], scalars[1], list(past), list(cross))
        return (logits.float(), *presents)


def cross_names(layers: int) -> tuple[tuple[str, str], ...]:
    return tuple((f"cross_key_{i}", f"cross_value_{i}") for i in range(layers))


def _export(module, args, path: Path, inputs, outputs, dynamic) -> None:
    attention.export_traced(module, args, path, inputs, outputs, dynamic=dynamic, translation=TRANSLATION)


def export_encoder(model, path: Path, family: str, layers: int, heads: int, head_dim: int, max_source: int, dtype: str):
    """The encoder graph: source ids -> each decoder layer's cross-attention K/V."""
    inputs = [TensorSpec("input_ids", "int64", (1, "source"))]
    names = cross_names(layers)
    outputs = [TensorSpec(n, dtype, (1, heads, "source", head_dim)) for pair in names for n in pair]
    io = GraphIO("input_ids", None, None, (), (), cross=names)
    example = min(7, max_source)
    n = torch.export.Dim("source", min=2, max=max(3, max_source))
    _export(_Encoder(model, family, heads), (torch.arange(example).view(1, example) % 5 + 3,), path, inputs, outputs, ({1: n},))
    return inputs, outputs, io


def export_encoder_batched(model, path: Path, family: str, layers: int, heads: int, head_dim: int, max_source: int, rows: int, dtype: str):
    """The encoder over B sources at once (B: 1..``rows``; traced at 2), right-padded to the longest and masked:
    input_ids, attention_mask int64 [B, N] -> each decoder layer's cross K/V [B, H, N, D]. Row b's
    first N_b positions are its source's K/V (what the batch-1 encoder writes); the runtime copies
    them into that row's slot once, at admission (engines/ort.py BatchEncoder)."""
    inputs = [TensorSpec("input_ids", "int64", ("B", "source")), TensorSpec("attention_mask", "int64", ("B", "source"))]
    names = cross_names(layers)
    outputs = [TensorSpec(n, dtype, ("B", heads, "source", head_dim)) for pair in names for n in pair]
    io = GraphIO("input_ids", None, None, (), (), cross=names, mask="attention_mask")
    example = min(7, max_source)
    ids = torch.arange(2 * example).view(2, example) % 5 + 3
    mask = torch.ones_like(ids)
    mask[1, example - 2 :] = 0  # the second source two tokens shorter
    b = torch.export.Dim("B", min=2, max=max(3, rows))
    n = torch.export.Dim("source", min=2, max=max(3, max_source))
    _export(_Encoder(model, family, heads), (ids, mask), path, inputs, outputs, ({0: b, 1: n}, {0: b, 1: n}))
    return inputs, outputs, io


def export_seq2seq_decoder(model, path: Path, family: str, tokens: int | None, max_seq: int, layers: int, heads: int, head_dim: int,
                           max_source: int, dtype: str):  # fmt: skip
    """A decoder graph (S = ``tokens`` per call, None: dynamic), reading the encoder's cross K/V."""
    inputs, outputs, io = signature(layers, heads, head_dim, model.config.vocab_size, max_seq, tokens, dtype)
    names = cross_names(layers)
    inputs += [TensorSpec(n, dtype, (1, heads, "source", head_dim)) for pair in names for n in pair]
    io = dataclasses.replace(io, cross=names)
    s = 3 if tokens is None else tokens
    src = min(7, max_source)
    t = TORCH_DTYPES[dtype]
    args = (
        torch.zeros(1, s, dtype=torch.long),
        torch.arange(s).view(1, s) + 2,
        [torch.tensor([s + 1], dtype=torch.int32), torch.tensor(s + 2, dtype=torch.int32)],
        [torch.zeros(1, heads, max_seq, head_dim, dtype=t) for _ in range(2 * layers)],
        [torch.randn(1, heads, src, head_dim).to(t) for _ in range(2 * layers)],
    )
    n = torch.export.Dim("source", min=2, max=max(3, max_source))
    seq = torch.export.Dim("S", min=1, max=max_seq) if tokens is None else None
    dynamic = ({1: seq} if seq else None, {1: seq} if seq else None, [None, None], [None] * (2 * layers), [{2: n}] * (2 * layers))
    _export(_Decoder(model, family, max_seq), args, path, inputs, outputs, dynamic)
    return inputs, outputs, io


class _RowsDecoder(torch.nn.Module):
    """B rows of a decoder call, each over its own self-attention buffers and its own source's
    cross K/V; inputs and outputs listed row-major (row b, layer i), as export/batched.py."""

    def __init__(self, model, family: str, max_seq: int, rows: int, layers: int):
        super().__init__()
        self.body, self.rows, self.layers = SEQ2SEQ[family].decoder(model, max_seq), rows, layers

    def per_layer(self, flat: list) -> list[list[torch.Tensor]]:
        """Row-major pairs (row b, layer i) -> per layer i: [keys of every row], [values of every row]."""
        at = lambda b, i, kv: flat[2 * (b * self.layers + i) + kv]  # noqa: E731
        return [[at(b, i, kv) for b in range(self.rows)] for i in range(self.layers) for kv in (0, 1)]

    def forward(self, input_ids, position_ids, seqlens_k, totals: list[torch.Tensor], past: list[torch.Tensor], cross: list[torch.Tensor]):
        logits, presents = self.body(input_ids, position_ids, seqlens_k, list(totals), self.per_layer(list(past)), self.per_layer(list(cross)))
        kv = [presents[2 * i + kv][b] for b in range(self.rows) for i in range(self.layers) for kv in (0, 1)]
        return (logits.float(), *kv)


def rows_signature(layers: int, rows: int, heads: int, head_dim: int, vocab: int, max_seq: int, dtype: str):
    """A batched decoder graph's signature (export/batched.py's) and each row's cross K/V
    ``cross_key_i_b`` [1, H, source_b, D], row-major as the KV pairs."""
    from specdec.export.batched import signature as batched_signature

    inputs, outputs, io = batched_signature(layers, rows, heads, head_dim, vocab, max_seq, dtype)
    names = tuple((f"cross_key_{i}_{b}", f"cross_value_{i}_{b}") for b in range(rows) for i in range(layers))
    inputs += [TensorSpec(n, dtype, (1, heads, f"source_{b}", head_dim)) for b in range(rows) for pair in names[b * layers : (b + 1) * layers]
               for n in pair]  # fmt: skip
    return inputs, outputs, dataclasses.replace(io, cross=names)


def export_seq2seq_batched(model, path: Path, family: str, rows: int, max_seq: int, layers: int, heads: int, head_dim: int,
                           max_source: int, dtype: str):  # fmt: skip
    """A decoder graph of ``rows`` rows (S dynamic), each row over its own KV slot and its own
    source's cross K/V (a source length per row): merged with the other row counts into the
    model's rows graph (export/rows.py)."""
    from specdec.export.batched import trace_args

    inputs, outputs, io = rows_signature(layers, rows, heads, head_dim, model.config.vocab_size, max_seq, dtype)
    args, seq = trace_args(rows, layers, heads, max_seq, head_dim, dtype)  # the decoder-only rows graph's, plus sources of 5 and 7 tokens
    sources = [min(5 + 2 * (b % 2), max_source) for b in range(rows)]
    args += ([torch.randn(1, heads, sources[b], head_dim).to(TORCH_DTYPES[dtype]) for b in range(rows) for _ in range(2 * layers)],)
    n = [torch.export.Dim(f"source_{b}", min=2, max=max(3, max_source)) for b in range(rows)]
    dynamic = ({1: seq}, {1: seq}, None, [None] * rows, [None] * (2 * layers * rows), [{2: n[b]} for b in range(rows) for _ in range(2 * layers)])
    _export(_RowsDecoder(model, family, max_seq, rows, layers), args, path, inputs, outputs, dynamic)
    return inputs, outputs, io

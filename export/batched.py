"""Export a batched decoder graph: B rows of S new tokens per call, each row over its own KV buffers.

ONNX Runtime's CPU GroupQueryAttention refuses batch > 1 when a call has more than one new
token and a past, so a batched verify call cannot run one GQA over all rows. This graph runs
everything but attention batched over the B rows (the weights are read once per call), and
attention as one batch-1 GQA per row and layer on that row's own buffers, appended in place:

    input_ids, position_ids [B, S] ──► embeddings, norms, MLPs, q/k/v, LM head: batched over B
                                          │
            per layer i, per row b:  q[b], k[b], v[b] ──► GQA(batch 1) ◄─► past_key_i_b / past_value_i_b
                                          │                               [1, kvH, MAX, D], in place
    logits [B, S, V] ◄────────────────────┘

Inputs: input_ids int64 [B, S], position_ids int64 [B, S] (row b: its own past + 0..S-1),
seqlens_k int32 [B] (row b: rows visible after the call - 1), total_sequence_length_b int32 []
(row b: rows visible after the call; an input of its own, as in the batch-1 graphs: computed in
the graph from seqlens_k, CUDA's GroupQueryAttention read it wrong, docs/gpu.md), and past_key_i_b /
past_value_i_b [1, kvH, MAX, D]; outputs logits float32 [B, S, V] and present_key_i_b /
present_value_i_b (the runtime binds them to the past buffers). B is static, S dynamic. The
runtime binds each row's buffers to whichever cache slot that row serves in a call, and points
unused rows at a scratch slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AttentionInterface

from specdec.export import attention
from specdec.export.attention import _active, _scaling
from specdec.manifest import GraphIO, TensorSpec

ATTN_NAME = "specdec_gqa_rows"


@dataclass
class RowsState:
    """Per-forward inputs: per layer, per row the past buffers; per row seqlens_k."""

    past_k: list[list[torch.Tensor]]  # [layer][row] -> [1, kvH, MAX, D]
    past_v: list[list[torch.Tensor]]
    seqlens_k: torch.Tensor  # int32 [B]
    totals: list[torch.Tensor]  # [row] -> int32 []: rows visible after the call
    present_k: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    present_v: dict[int, list[torch.Tensor]] = field(default_factory=dict)


def rows_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, softcap=None, **kwargs):
    """query [B, H, S, D], key/value [B, kvH, S, D] (new rows only) -> [B, S, H, D], one GQA per row.

    The rows are laid out for GQA once and split once per tensor: a slice, transpose and reshape
    per row and tensor made the graph ~3.4x larger at 16 rows, and the exporter's rewrites grow
    faster than the graph (16 rows x 8 layers: 114 s to export and 26 s to optimize, against 29
    and 4 s)."""
    state = _active[-1]
    rows, h, s, d = query.shape
    kvh = key.shape[1]
    layer = module.layer_idx
    q = query.transpose(1, 2).reshape(rows, s, h * d).split(1)  # B x [1, S, H*D]
    k = key.transpose(1, 2).reshape(rows, s, kvh * d).split(1)  # B x [1, S, kvH*D]
    v = value.transpose(1, 2).reshape(rows, s, kvh * d).split(1)
    outs, pks, pvs = [], [], []
    for b in range(rows):
        out, pk, pv = torch.ops.specdec.gqa(
            q[b], k[b], v[b], state.past_k[layer][b], state.past_v[layer][b], state.seqlens_k[b : b + 1], state.totals[b],
            h, kvh, _scaling(module, d, scaling), int(sliding_window or 0), float(softcap or 0.0),
        )  # fmt: skip
        outs.append(out)
        pks.append(pk)
        pvs.append(pv)
    state.present_k[layer], state.present_v[layer] = pks, pvs
    return torch.cat(outs, dim=0).view(rows, s, h, d), None


AttentionInterface.register(ATTN_NAME, rows_attention)


class _RowsWrapper(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, rows: int):
        super().__init__()
        self.model, self.rows = model, rows

    def forward(self, input_ids, position_ids, seqlens_k, totals: list[torch.Tensor], past: list[torch.Tensor]):
        layers = self.model.config.num_hidden_layers
        # past is row-major: row b, layer i -> past[2 * (b * layers + i)] (key), + 1 (value)
        pk = [[past[2 * (b * layers + i)] for b in range(self.rows)] for i in range(layers)]
        pv = [[past[2 * (b * layers + i) + 1] for b in range(self.rows)] for i in range(layers)]
        state = RowsState(pk, pv, seqlens_k, totals)
        with attention.call_state(state):
            out = self.model(input_ids=input_ids, position_ids=position_ids, past_key_values=attention.PassThroughCache(), use_cache=True)
        kv = []
        for b in range(self.rows):
            for i in range(layers):
                kv += [state.present_k[i][b], state.present_v[i][b]]
        return (out.logits.float(), *kv)


def signature(layers: int, rows: int, kv_heads: int, head_dim: int, vocab: int, max_seq: int, dtype: str):
    """Inputs, outputs and I/O roles of a batched graph (past/present listed row-major)."""
    kv = (1, kv_heads, max_seq, head_dim)
    totals = tuple(f"total_sequence_length_{b}" for b in range(rows))
    inputs = [TensorSpec("input_ids", "int64", (rows, "S")), TensorSpec("position_ids", "int64", (rows, "S")),
              TensorSpec("seqlens_k", "int32", (rows,)), *(TensorSpec(t, "int32", ()) for t in totals)]  # fmt: skip
    outputs = [TensorSpec("logits", "float32", (rows, "S", vocab))]
    past = [(f"past_key_{i}_{b}", f"past_value_{i}_{b}") for b in range(rows) for i in range(layers)]
    present = [(f"present_key_{i}_{b}", f"present_value_{i}_{b}") for b in range(rows) for i in range(layers)]
    for (pk, pv), (nk, nv) in zip(past, present):
        inputs += [TensorSpec(pk, dtype, kv), TensorSpec(pv, dtype, kv)]
        outputs += [TensorSpec(nk, dtype, kv), TensorSpec(nv, dtype, kv)]
    return inputs, outputs, GraphIO("input_ids", "position_ids", "logits", tuple(past), tuple(present), seqlens="seqlens_k", totals=totals)


def trace_args(rows: int, layers: int, kv_heads: int, max_seq: int, head_dim: int, dtype: str) -> tuple:
    """A batched graph's example inputs: rows of 3 new tokens after 2 and 5 committed rows
    (ids, positions, seqlens_k, per-row totals, row-major past buffers), and the dynamic S."""
    from specdec.export.graphs import TORCH_DTYPES

    s = 3
    starts = torch.tensor([2 + 3 * (b % 2) for b in range(rows)])
    args = (
        torch.zeros(rows, s, dtype=torch.long),
        starts[:, None] + torch.arange(s)[None, :],
        (starts + s - 1).to(torch.int32),
        [(starts[b] + s).to(torch.int32) for b in range(rows)],  # [] each
        [torch.zeros(1, kv_heads, max_seq, head_dim, dtype=TORCH_DTYPES[dtype]) for _ in range(2 * layers * rows)],
    )
    return args, torch.export.Dim("S", min=1, max=max_seq)


def export_batched(model: torch.nn.Module, path: Path, rows: int, max_seq: int, kv_heads: int, head_dim: int, dtype: str):
    """Export ``model`` to ``path`` (+ external data) as a ``rows``-row graph with dynamic S."""
    cfg = model.config
    layers = cfg.num_hidden_layers
    inputs, outputs, io = signature(layers, rows, kv_heads, head_dim, cfg.vocab_size, max_seq, dtype)
    args, dim = trace_args(rows, layers, kv_heads, max_seq, head_dim, dtype)
    dynamic = ({1: dim}, {1: dim}, None, [None] * rows, [None] * (2 * layers * rows))
    attention.export_traced(_RowsWrapper(model, rows), args, path, inputs, outputs, config=cfg, attn=ATTN_NAME, dynamic=dynamic)
    return inputs, outputs, io


def one_row(dynamic: Path, path: Path, layers: int, kv_heads: int, head_dim: int, vocab: int, max_seq: int, dtype: str):
    """Write ``path``: the 1-row batched graph (a rows graph's body for one row alone), which is
    the model's ORT dynamic graph at ``dynamic`` (optimized and quantized already) under the
    batched graph's names (past_key_i -> past_key_i_0, total_sequence_length ->
    total_sequence_length_0, ...): one row's batched attention is that graph's attention, so it
    is not traced again. Weights stay where ``dynamic``'s point (its external data)."""
    import onnx

    from specdec.export.graphs import signature as decoder_signature

    inputs, outputs, io = signature(layers, 1, kv_heads, head_dim, vocab, max_seq, dtype)
    _, _, one = decoder_signature(layers, kv_heads, head_dim, vocab, max_seq, None, dtype)
    names = {one.total: io.totals[0]} | {a: b for mine, its in ((one.past, io.past), (one.present, io.present))
                                          for pair, renamed in zip(mine, its) for a, b in zip(pair, renamed)}  # fmt: skip
    proto = onnx.load(str(dynamic), load_external_data=False)
    graph = proto.graph
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node for a in n.attribute):
        raise ValueError(f"{dynamic.name}: a node with a subgraph; a rows body is a flat graph")
    for v in (*graph.input, *graph.output, *graph.value_info):
        v.name = names.get(v.name, v.name)
    for n in graph.node:
        ins, outs = [names.get(i, i) for i in n.input], [names.get(o, o) for o in n.output]
        del n.input[:], n.output[:]
        n.input.extend(ins)
        n.output.extend(outs)
    onnx.save_model(proto, str(path))
    return inputs, outputs, io

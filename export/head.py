"""The feature drafter's head (EAGLE-style): one decoder layer over [token embedding ; target feature].

    row j of a call:   x_j = W_fc [E[token_j] ; c_j]            c_j: the target's feature of
                       h_j = Norm(DecoderLayer(x)_j)               position j - 1 (0 at j = 0), or
                       logits_j = h_j @ H                          the head's own h_{j-1} when drafting
    E [V, d], H [d, V]: the target's own embedding table and LM head, read from the bundle's
    target graph (never trained, never stored twice: the head graph points at the target's
    weight file for them, export/weights.py ``share_with``). h_j is trained to be the target's
    feature f_j, so logits_j approximate the target's distribution of token j + 1.

The head graph ("head", role "dynamic") has the target graphs' signature plus ``context``
[1, S, d] in and ``features`` [1, S, d] out, with its own one-layer KV cache (the same
GroupQueryAttention over preallocated buffers as every ORT graph). Its decoder layer is
Llama's (RMSNorm, RoPE, SwiGLU) whatever the target's family: it only has to predict
features, and its shape (heads, KV heads, head dim) is the target's.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specdec.export import attention
from specdec.export.graphs import FLAVOURS, TORCH_DTYPES
from specdec.manifest import GraphIO, TensorSpec
from specdec.runtime.sampling import NEVER  # the head's logit for a token outside its draft vocabulary (the runtime draws around it)

CONFIG_NAME = "head_config.json"
WEIGHTS_NAME = "head.safetensors"


@dataclass(frozen=True)
class HeadConfig:
    """The head's shape: d the target's feature width, its attention shape the target's."""

    width: int  # d
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int
    rope_theta: float = 10000.0
    eps: float = 1e-6
    draft_vocab: int | None = None  # None: draft over the whole vocabulary; N: over N tokens only (EAGLE-3's reduced draft vocabulary)

    def llama(self):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=1, hidden_size=self.width, intermediate_size=self.intermediate, num_hidden_layers=1,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
            max_position_embeddings=self.max_positions, rms_norm_eps=self.eps, rope_theta=self.rope_theta,
            tie_word_embeddings=False,
        )  # fmt: skip


class FeatureHead(nn.Module):
    """The head over the target's frozen tables ``embed`` [V, d] and ``head_t`` [d, V].

    With ``cfg.draft_vocab`` = N the head drafts only the N tokens ``vocab_ids`` (a buffer saved
    with the head; the most frequent training tokens): its LM head is the target's columns for
    them [d, N], N/V of the cost, and every other token gets logit ``NEVER`` (q = 0, which
    speculative sampling handles exactly: such tokens come only from the residual)."""

    first = 0  # the first position it reads (export/train_head.py); EAGLE-3's heads start at 1
    regress = True  # its output h is pulled to the target's feature in training

    def __init__(self, cfg: HeadConfig, embed: torch.Tensor, head_t: torch.Tensor, vocab_ids: torch.Tensor | None = None, tied: bool = False):
        super().__init__()
        from transformers import LlamaModel

        self.cfg = cfg
        self.fc = nn.Linear(2 * cfg.width, cfg.width, bias=False)
        self.model = LlamaModel(cfg.llama())
        self.model.embed_tokens.requires_grad_(False)  # unused: the head embeds with the target's table
        self.tied = tied  # embed by gathering columns of ``full_head_t``, as the target graph does (one tensor to share)
        self.register_buffer("embed", None if tied else embed.float(), persistent=False)  # [V, d]
        self.register_buffer("full_head_t", head_t.float(), persistent=False)  # [d, V]: the target's distributions in training
        ids = torch.arange(cfg.vocab) if vocab_ids is None else vocab_ids.long()
        if cfg.draft_vocab is not None and len(ids) != cfg.draft_vocab:
            raise ValueError(f"draft_vocab={cfg.draft_vocab} but {len(ids)} vocab_ids")
        self.register_buffer("vocab_ids", ids, persistent=cfg.draft_vocab is not None)  # [N]
        self.register_buffer("head_t", head_t.float()[:, ids].contiguous() if cfg.draft_vocab else head_t.float(), persistent=False)  # [d, N]
        self.config = self.model.config  # what export reads (attention implementation, layers)

    def draft_logits(self, input_ids, position_ids, context, past_key_values=None, use_cache=False):
        """ids [B, S], positions [B, S], context [B, S, d] -> (logits [B, S, N] over the draft vocabulary, features [B, S, d])."""
        if self.tied:  # Gather(axis=1) of the [d, V] head, as the target graph embeds
            e = torch.index_select(self.full_head_t, 1, input_ids.reshape(-1)).T.reshape(*input_ids.shape, -1)
        else:
            e = nn.functional.embedding(input_ids, self.embed)
        x = self.fc(torch.cat([e, context], dim=-1))
        h = self.model(inputs_embeds=x, position_ids=position_ids, past_key_values=past_key_values, use_cache=use_cache).last_hidden_state
        return h @ self.head_t, h

    def forward(self, input_ids, position_ids, context, past_key_values=None, use_cache=False):
        """ids [B, S], positions [B, S], context [B, S, d] -> (logits [B, S, V], features [B, S, d])."""
        small, h = self.draft_logits(input_ids, position_ids, context, past_key_values, use_cache)
        if self.cfg.draft_vocab is None:
            return small, h
        full = small.new_full((*small.shape[:-1], self.cfg.vocab), NEVER, dtype=torch.float32)  # NEVER is -inf in float16
        return full.scatter(-1, self.vocab_ids.expand(*small.shape[:-1], -1), small.float()), h

    def trained_state(self) -> dict[str, torch.Tensor]:
        """The head's own weights (fc and the layer; not the target's tables)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("model.embed_tokens")}


def save_head(head: FeatureHead, folder: Path, record: dict) -> None:
    """A head checkpoint: its config, its own weights (safetensors) and how it was trained."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_NAME).write_text(json.dumps({"head": asdict(head.cfg), "training": record}, indent=1))
    save_file({k: v.contiguous() for k, v in head.trained_state().items()}, str(folder / WEIGHTS_NAME))


def load_head(folder: Path, embed: torch.Tensor, head_t: torch.Tensor, tied: bool = False) -> tuple[FeatureHead, dict]:
    """A saved head over the target's tables; returns it and its training record."""
    from safetensors.torch import load_file

    from specdec.errors import ExportError

    meta = json.loads((folder / CONFIG_NAME).read_text())
    cfg = HeadConfig(**meta["head"])
    if (cfg.vocab, cfg.width) != tuple(embed.shape):
        raise ExportError(f"feature head {folder} was trained for a [{cfg.vocab}, {cfg.width}] embedding, this target's is "
                          f"{list(embed.shape)}; train one for it with specdec train-drafter")  # fmt: skip
    state = load_file(str(folder / WEIGHTS_NAME))
    head = FeatureHead(cfg, embed, head_t, state.get("vocab_ids"), tied)
    missing, unexpected = head.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not k.startswith("model.embed_tokens")]:
        raise ExportError(f"feature head {folder}: weights do not match its config (missing {missing}, unexpected {unexpected})")
    return head.eval(), meta.get("training", {})


class _Wrapper(nn.Module):
    """The head on S new tokens with GroupQueryAttention over its one-layer buffers."""

    def __init__(self, head: FeatureHead):
        super().__init__()
        self.head = head
        self.flavour = FLAVOURS["ort"]

    def forward(self, input_ids, position_ids, context, scalars: list[torch.Tensor], past: list[torch.Tensor]):
        state = self.flavour.state([past[0]], [past[1]], *scalars)
        context = context.to(past[0].dtype)  # the host's float32 rows, in the head's precision
        with attention.call_state(state):
            logits, h = self.head(input_ids, position_ids, context, past_key_values=attention.PassThroughCache(), use_cache=True)
        return (logits.float(), h.float(), *self.flavour.kv_out(state, 0))


def signature(cfg: HeadConfig, max_seq: int, dtype: str, batch: int = 1):
    """The head graph's TensorSpecs and GraphIO (dynamic S)."""
    fl = FLAVOURS["ort"]
    kv = (batch, cfg.num_kv_heads, max_seq, cfg.head_dim)
    inputs = [TensorSpec("input_ids", "int64", (batch, "S")), TensorSpec("position_ids", "int64", (batch, "S")),
              TensorSpec("context", "float32", (batch, "S", cfg.width))]  # fmt: skip
    inputs += [TensorSpec(name, dt, shape) for name, dt, shape, _ in fl.scalars]
    inputs += [TensorSpec("past_key_0", dtype, kv), TensorSpec("past_value_0", dtype, kv)]
    outputs = [TensorSpec("logits", "float32", (batch, "S", cfg.vocab)), TensorSpec("features", "float32", (batch, "S", cfg.width)),
               TensorSpec("present_key_0", dtype, kv), TensorSpec("present_value_0", dtype, kv)]  # fmt: skip
    io = GraphIO("input_ids", "position_ids", "logits", (("past_key_0", "past_value_0"),), (("present_key_0", "present_value_0"),),
                 features="features", context="context", **{role: name for name, _, _, role in fl.scalars})  # fmt: skip
    return inputs, outputs, io


def export_head(head: FeatureHead, path: Path, max_seq: int, dtype: str = "float32"):
    """Trace the head to ``path`` (+ its data file), dynamic S; returns (inputs, outputs, io)."""
    cfg = head.cfg
    inputs, outputs, io = signature(cfg, max_seq, dtype)
    if dtype != "float32":  # a float16 bundle: the head's weights and tables in float16, its context and outputs float32
        head = copy.deepcopy(head).to(TORCH_DTYPES[dtype])
    fl = FLAVOURS["ort"]
    s = 3
    args = (
        torch.zeros(1, s, dtype=torch.long),
        torch.arange(s).view(1, s) + 2,
        torch.zeros(1, s, cfg.width),
        fl.example(s),
        [torch.zeros(1, cfg.num_kv_heads, max_seq, cfg.head_dim, dtype=TORCH_DTYPES[dtype]) for _ in range(2)],
    )
    dim = torch.export.Dim("S", min=1, max=max_seq)
    dynamic = ({1: dim}, {1: dim}, {1: dim}, [None] * len(fl.scalars), [None, None])
    attention.export_traced(_Wrapper(head), args, path, inputs, outputs, config=head.config, attn=fl.attn, dynamic=dynamic)
    return inputs, outputs, io


def reference(head: FeatureHead, ids: np.ndarray, context: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The head in PyTorch (eager attention, no cache) on one sequence: logits [S, V], features [S, d]."""
    with torch.no_grad():
        t = torch.from_numpy(np.asarray(ids, dtype=np.int64))[None]
        logits, h = head(t, torch.arange(t.shape[1])[None], torch.from_numpy(np.asarray(context, dtype=np.float32))[None])
    return logits[0].numpy(), h[0].numpy()

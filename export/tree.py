"""Export a tree verify graph: N drafted nodes, each attending to the past and its own ancestors.

    input_ids     int64 [1, N]       the nodes' tokens, in topological order (parents first)
    position_ids  int64 [1, N]       past + depth of each node (siblings share a position)
    seqlens_k     int32 [1]          past + N - 1
    total_sequence_length int32 []   past + N
    tree_bias     float32 [1, 1, N, N]  0 where node j is node i or an ancestor of it, else -1e30
                                     (engines/ort.py ``tree_bias``, which the runtime fills)
    past_key_i / past_value_i [1, kvH, MAX, D]  the cache, bound in place (as graphs.py)
      -> logits [1, N, V] (node i's next-token scores), present_key_i / present_value_i

GroupQueryAttention writes node i's K/V at row past + i and applies its causal mask over the N
new rows (a tree in topological order only ever needs a subset of it); ``tree_bias`` hides the
non-ancestors (tests/engines/test_tree_attention.py: the CPU kernel takes the mask through
``attention_bias``). The graph widens the bias to [1, 1, N, past + N] with zeros for the past.
Rotary reads ``position_ids`` (past + depth, not past + index), so the rotary stays its own
node: export/optimize.py moves rotary into GroupQueryAttention only for 7-input calls, which
would number positions by index.

After verification the runtime keeps the accepted path: its rows move to past, past + 1, ...
(a few rows per layer) and the cache length becomes past + path length (issue 28).

Not yet: sliding-window models (a window must be counted in positions, not rows), Gemma 2's
soft-capping, batched rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnxscript
import torch
from onnxscript import opset18 as op
from transformers import AttentionInterface

from specdec.export import attention
from specdec.export.attention import _active, _scaling
from specdec.export.graphs import TORCH_DTYPES, kv_specs
from specdec.manifest import GraphIO, TensorSpec

ATTN_NAME = "specdec_gqa_tree"


def unsupported(cfg) -> list[str]:
    """Config options a tree verify graph cannot take yet (a window must count positions, not rows)."""
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    bad = [f"sliding_window={window}"] if window else []
    return bad + ([f"attn_logit_softcapping={cfg.attn_logit_softcapping}"] if getattr(cfg, "attn_logit_softcapping", None) else [])


@attention.gqa_op("gqa_tree", "Tensor tree_bias, SymInt num_heads, SymInt kv_heads, float scale")
def gqa_tree(query, key, value, past_key, past_value, seqlens_k, total_len, tree_bias, num_heads, kv_heads, scale):
    """Reference semantics: query [1, N, H*D], key/value [1, N, kvH*D], past_* [1, kvH, MAX, D],
    tree_bias [1, 1, N, N]; the N new rows go to [total - N, total)."""
    s, start = query.shape[1], int(total_len) - query.shape[1]
    bias = torch.cat([torch.zeros(1, 1, s, start, dtype=tree_bias.dtype), tree_bias], dim=-1)  # [1, 1, N, T]: the past all visible
    return attention.reference_attention(query, key, value, past_key, past_value, total_len, num_heads, kv_heads, scale, bias=bias)


_MSFT = onnxscript.values.Opset("com.microsoft", 1)


def _gqa_tree_to_onnx(query, key, value, past_key, past_value, seqlens_k, total_len, tree_bias, num_heads: int, kv_heads: int,
                      scale: float):  # fmt: skip
    nodes = op.Shape(tree_bias, start=2, end=3)  # [1]: N
    past = op.Sub(op.Reshape(op.Cast(total_len, to=7), op.Constant(value_ints=[1])), nodes)  # [1], int64
    zeros = op.ConstantOfShape(op.Concat(op.Constant(value_ints=[1, 1]), nodes, past, axis=0))  # [1, 1, N, past], float32 zeros
    bias = op.CastLike(op.Concat(op.CastLike(zeros, tree_bias), tree_bias, axis=3), query)  # [1, 1, N, past + N], in attention's type
    # (float16: -1e30 becomes -inf, which a row never holds alone: its past and its own node are 0)
    return _MSFT.GroupQueryAttention(
        query, key, value, past_key, past_value, seqlens_k, total_len, None, None, None, bias,
        num_heads=num_heads, kv_num_heads=kv_heads, scale=scale, local_window_size=-1,
    )  # fmt: skip


TRANSLATION = {**attention.CUSTOM_TRANSLATION, torch.ops.specdec.gqa_tree.default: _gqa_tree_to_onnx}


@dataclass
class TreeState(attention._CallState):
    """The attention call state with the tree's ancestor bias [1, 1, N, N] (0: visible, -inf: not)."""

    tree_bias: torch.Tensor | None = None


def tree_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, softcap=None, **kwargs):
    """query [1, H, N, D], key/value [1, kvH, N, D] (the nodes' rows) -> [1, N, H, D]."""
    if sliding_window or softcap:
        raise NotImplementedError("tree verify graphs do not take sliding windows or soft-capping yet")
    state = _active[-1]
    b, h, s, d = query.shape
    kvh = key.shape[1]
    layer = module.layer_idx
    out, pk, pv = torch.ops.specdec.gqa_tree(
        query.transpose(1, 2).reshape(b, s, h * d), key.transpose(1, 2).reshape(b, s, kvh * d),
        value.transpose(1, 2).reshape(b, s, kvh * d), state.past_k[layer], state.past_v[layer], state.seqlens_k,
        state.total_len, state.tree_bias, h, kvh, _scaling(module, d, scaling),
    )  # fmt: skip
    state.present_k[layer], state.present_v[layer] = pk, pv
    return out.view(b, s, h, d), None


AttentionInterface.register(ATTN_NAME, tree_attention)


class _TreeWrapper(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, seqlens_k, total_len, tree_bias, past: list[torch.Tensor]):
        state = TreeState(list(past[0::2]), list(past[1::2]), seqlens_k, total_len, tree_bias=tree_bias)
        with attention.call_state(state):
            out = self.model(input_ids=input_ids, position_ids=position_ids, past_key_values=attention.PassThroughCache(), use_cache=True)
        kv = []
        for i in range(self.model.config.num_hidden_layers):
            kv += [state.present_k[i], state.present_v[i]]
        return (out.logits.float(), *kv)


def signature(layers: int, kv_heads: int, head_dim: int, vocab: int, max_seq: int, nodes: int, dtype: str):
    """Inputs, outputs and I/O roles of a tree verify graph of ``nodes`` nodes."""
    kv = (1, kv_heads, max_seq, head_dim)
    inputs = [TensorSpec("input_ids", "int64", (1, nodes)), TensorSpec("position_ids", "int64", (1, nodes)),
              TensorSpec("seqlens_k", "int32", (1,)), TensorSpec("total_sequence_length", "int32", ()),
              TensorSpec("tree_bias", "float32", (1, 1, nodes, nodes))]  # fmt: skip
    outputs = [TensorSpec("logits", "float32", (1, nodes, vocab))]
    past, present = kv_specs(inputs, outputs, layers, dtype, kv, kv)
    io = GraphIO("input_ids", "position_ids", "logits", tuple(past), tuple(present), seqlens="seqlens_k", total="total_sequence_length",
                 tree_bias="tree_bias")  # fmt: skip
    return inputs, outputs, io


def export_tree_verify(model: torch.nn.Module, path: Path, nodes: int, max_seq: int, kv_heads: int, head_dim: int, dtype: str):
    """Export ``model``'s verify graph for trees of ``nodes`` nodes to ``path`` (+ external data)."""
    cfg = model.config
    layers = cfg.num_hidden_layers
    inputs, outputs, io = signature(layers, kv_heads, head_dim, cfg.vocab_size, max_seq, nodes, dtype)
    past = 2  # trace after 2 committed rows, every node a child of the previous (a chain)
    args = (
        torch.zeros(1, nodes, dtype=torch.long),
        torch.arange(nodes).view(1, nodes) + past,
        torch.tensor([past + nodes - 1], dtype=torch.int32),
        torch.tensor(past + nodes, dtype=torch.int32),
        torch.zeros(1, 1, nodes, nodes),
        [torch.zeros(1, kv_heads, max_seq, head_dim, dtype=TORCH_DTYPES[dtype]) for _ in range(2 * layers)],
    )
    attention.export_traced(_TreeWrapper(model), args, path, inputs, outputs, config=cfg, attn=ATTN_NAME, translation=TRANSLATION)
    return inputs, outputs, io

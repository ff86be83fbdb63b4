"""Attention that exports to ONNX Runtime's GroupQueryAttention over a shared, in-place KV buffer.

Transformers' attention layers call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``
after rotary and after ``past_key_values.update``. During export we register our own function
and hand the model a cache whose ``update`` returns only the new rows, so the function sees
the new K/V of this call and reads the preallocated buffers from the export state:

    q, k_new, v_new (after rotary)          past_key_i / past_value_i  [1, kvH, MAX, D]
              \\            |                       /
               specdec::gqa  ->  com.microsoft::GroupQueryAttention
              /                 \\
    attention output           present_key_i / present_value_i  [1, kvH, MAX, D]

The runtime binds past and present to the same buffer: ORT writes the new rows at
[total - S, total) in place, and reads rows [0, total) only, so rolling back is choosing a
smaller total on the next call. Positions come in as ``position_ids``; the family's own
embedding code (rotary, learned, absolute) turns them into whatever it uses.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import onnx
import onnxscript
import torch
from onnx.defs import OpSchema
from transformers import AttentionInterface, DynamicCache

ATTN_NAME = "specdec_gqa"


GQA_INPUTS = "Tensor query, Tensor key, Tensor value, Tensor past_key, Tensor past_value, Tensor seqlens_k, Tensor total_len"


def gqa_op(name: str, extra: str):
    """Declares ``specdec::<name>``: GroupQueryAttention's seven tensor inputs, then ``extra``
    (schema text), returning the output and the two written buffers. Its fake (for tracing)
    gives tensors shaped as query and the buffers; the body is the decorated function."""

    def declare(fn):
        op = torch.library.custom_op(f"specdec::{name}", fn, mutates_args=(), schema=f"({GQA_INPUTS}, {extra}) -> (Tensor, Tensor, Tensor)")
        op.register_fake(_gqa_fake)
        return op

    return declare


def _gqa_fake(query, key, value, past_key, past_value, *attrs):
    return torch.empty_like(query), torch.empty_like(past_key), torch.empty_like(past_value)


@gqa_op("gqa", "SymInt num_heads, SymInt kv_heads, float scale, SymInt local_window, float softcap=0.")
def gqa(query, key, value, past_key, past_value, seqlens_k, total_len, num_heads, kv_heads, scale, local_window, softcap=0.0):
    """Reference semantics of GroupQueryAttention (batch 1), for running the wrapper in torch.

    query [1, S, H*D], key/value [1, S, kvH*D], past_* [1, kvH, MAX, D]; the S new rows go to
    [total - S, total); token i attends to rows j <= total - S + i and, with a window, to the
    last ``local_window`` of them (itself included: i - j < window, as transformers' sliding
    masks and ORT's local_window_size alike). ``softcap`` > 0: scores -> softcap * tanh(scores /
    softcap) before the mask (Gemma 2).
    """
    return reference_attention(query, key, value, past_key, past_value, total_len, num_heads, kv_heads, scale,
                               local_window=local_window, softcap=softcap)  # fmt: skip


def reference_attention(query, key, value, past_key, past_value, total_len, num_heads: int, kv_heads: int, scale: float,
                        bias=None, local_window: int = 0, softcap: float = 0.0):  # fmt: skip
    """GroupQueryAttention's semantics (batch 1), shared by the custom ops' torch bodies
    (``specdec::gqa``, seq2seq's ``gqa_bias``, the tree graph's ``gqa_tree``): the S new rows
    written at [total - S, total), causal attention over rows [0, total), scores soft-capped,
    plus an additive ``bias`` [1, H or 1, S, >= total] (its first total columns), within the window.
    Returns output [1, S, H*D] and the written buffers."""
    b, s, _ = query.shape
    d = past_key.shape[-1]
    total = int(total_len)
    start = total - s
    pk, pv = write_rows(past_key, past_value, key, value, start, total)
    q = query.view(b, s, num_heads, d).transpose(1, 2)  # [1, H, S, D]
    rep = num_heads // kv_heads
    k = pk[:, :, :total].repeat_interleave(rep, 1)  # [1, H, T, D]
    v = pv[:, :, :total].repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2)) * scale  # [1, H, S, T]
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias[..., :total]
    i = torch.arange(s)[:, None] + start
    j = torch.arange(total)[None, :]
    visible = j <= i
    if local_window > 0:
        visible &= (i - j) < local_window
    out = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v
    return out.transpose(1, 2).reshape(b, s, num_heads * d), pk, pv


def write_rows(past_key, past_value, key, value, start: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the buffers [1, kvH, MAX, D] with the new rows key/value [1, S, kvH*D] at [start, total)."""
    b, s, _ = key.shape
    heads, d = past_key.shape[1], past_key.shape[-1]
    pk, pv = past_key.clone(), past_value.clone()
    pk[:, :, start:total] = key.view(b, s, heads, d).transpose(1, 2)
    pv[:, :, start:total] = value.view(b, s, heads, d).transpose(1, 2)
    return pk, pv


def _register_gqa_schema() -> None:
    """The onnx package does not know ORT contrib ops; onnxscript needs a schema to emit one."""
    if onnx.defs.has("GroupQueryAttention", "com.microsoft"):
        return
    formal, optional = OpSchema.FormalParameter, OpSchema.FormalParameterOption.Optional
    attr, kind = OpSchema.Attribute, OpSchema.AttrType
    onnx.defs.register_schema(
        OpSchema(
            "GroupQueryAttention",
            "com.microsoft",
            1,
            inputs=[
                formal("query", "T"),
                formal("key", "T", param_option=optional),
                formal("value", "T", param_option=optional),
                formal("past_key", "T", param_option=optional),
                formal("past_value", "T", param_option=optional),
                formal("seqlens_k", "M"),
                formal("total_sequence_length", "M"),
                formal("cos_cache", "T", param_option=optional),
                formal("sin_cache", "T", param_option=optional),
                formal("position_ids", "I", param_option=optional),
                formal("attention_bias", "T", param_option=optional),  # T5's relative bias (export/seq2seq.py)
            ],
            outputs=[formal("output", "T"), formal("present_key", "T"), formal("present_value", "T")],
            type_constraints=[("T", ["tensor(float)", "tensor(float16)"], ""), ("M", ["tensor(int32)"], ""), ("I", ["tensor(int64)"], "")],
            attributes=[
                attr("num_heads", kind.INT, ""),
                attr("kv_num_heads", kind.INT, ""),
                attr("scale", kind.FLOAT, ""),
                attr("local_window_size", kind.INT, ""),
                attr("softcap", kind.FLOAT, ""),
            ],
        )
    )


_register_gqa_schema()
_MSFT = onnxscript.values.Opset("com.microsoft", 1)


def _gqa_to_onnx(query, key, value, past_key, past_value, seqlens_k, total_len, num_heads: int, kv_heads: int, scale: float,
                 local_window: int, softcap: float = 0.0):  # fmt: skip
    window = local_window if local_window > 0 else -1
    if softcap > 0:  # the attribute only where it is used: other graphs stay as ORT < 1.19 reads them
        return _MSFT.GroupQueryAttention(
            query, key, value, past_key, past_value, seqlens_k, total_len,
            num_heads=num_heads, kv_num_heads=kv_heads, scale=scale, local_window_size=window, softcap=float(softcap),
        )  # fmt: skip
    return _MSFT.GroupQueryAttention(
        query, key, value, past_key, past_value, seqlens_k, total_len,
        num_heads=num_heads, kv_num_heads=kv_heads, scale=scale, local_window_size=window,
    )  # fmt: skip


CUSTOM_TRANSLATION = {torch.ops.specdec.gqa.default: _gqa_to_onnx}


@dataclass
class _CallState:
    """Per-forward inputs the attention function needs but transformers does not pass it."""

    past_k: list[torch.Tensor]
    past_v: list[torch.Tensor]
    seqlens_k: torch.Tensor
    total_len: torch.Tensor
    present_k: dict[int, torch.Tensor] = field(default_factory=dict)
    present_v: dict[int, torch.Tensor] = field(default_factory=dict)


_active: list = []  # the state of the forward being traced; set only inside `call_state`


@contextlib.contextmanager
def call_state(state):
    """Make ``state`` visible to the attention functions during one wrapper forward."""
    _active.append(state)
    try:
        yield state
    finally:
        _active.pop()


class PassThroughCache(DynamicCache):
    """A cache whose ``update`` hands back only the new rows: the real cache is the ORT buffer."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # 4.57: cache_kwargs; 5.x: kwargs=
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def _scaling(module: torch.nn.Module, head_dim: int, scaling: float | None) -> float:
    """The softmax scale. GPT-2 passes none and keeps its options on the module."""
    if scaling is not None:
        return float(scaling)
    scale = 1.0 / math.sqrt(head_dim) if getattr(module, "scale_attn_weights", True) else 1.0
    return scale


def gqa_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, softcap=None, **kwargs):
    """query [1, H, S, D], key/value [1, kvH, S, D] (new rows only) -> output [1, S, H, D]."""
    state = _active[-1]
    b, h, s, d = query.shape
    kvh = key.shape[1]
    layer = module.layer_idx
    out, pk, pv = torch.ops.specdec.gqa(
        query.transpose(1, 2).reshape(b, s, h * d),
        key.transpose(1, 2).reshape(b, s, kvh * d),
        value.transpose(1, 2).reshape(b, s, kvh * d),
        state.past_k[layer], state.past_v[layer], state.seqlens_k, state.total_len,
        h, kvh, _scaling(module, d, scaling), int(sliding_window or 0), float(softcap or 0.0),
    )  # fmt: skip
    state.present_k[layer], state.present_v[layer] = pk, pv
    return out.view(b, s, h, d), None


AttentionInterface.register(ATTN_NAME, gqa_attention)


def export_traced(module: torch.nn.Module, args: tuple, path, inputs, outputs, *, config=None, attn: str | None = None,
                  dynamic=None, translation: dict | None = None) -> None:  # fmt: skip
    """Trace ``module`` to ``path`` (+ its external data), the inputs and outputs named by the
    TensorSpecs; ``config``'s attention implementation is ``attn`` for the trace only. The one
    ``torch.onnx.export`` call of every graph kind."""
    previous = config._attn_implementation if config is not None else None
    if config is not None:
        config._attn_implementation = attn
    try:
        with torch.no_grad():
            program = torch.onnx.export(
                module.eval(), args, dynamo=True, input_names=[t.name for t in inputs], output_names=[t.name for t in outputs],
                dynamic_shapes=dynamic, custom_translation_table=translation or CUSTOM_TRANSLATION, optimize=True, verbose=False,
            )  # fmt: skip
    finally:
        if config is not None:
            config._attn_implementation = previous
    program.save(str(path), external_data=True)

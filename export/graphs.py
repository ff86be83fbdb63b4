"""Export one decoder graph: S new tokens per call over preallocated KV buffers.

Both flavours take (batch 1; L layers; kvH KV heads; D head dim; MAX = max-seq-len)
    input_ids    int64 [1, S]
    position_ids int64 [1, S]                    past + 0..S-1
    past_key_i / past_value_i  [1, kvH, MAX, D]  the preallocated buffers, i = 0..L-1
and return logits float32 [1, S, V] for every position (never last-only). They differ in:

    flavour   scalar inputs (GraphIO role)                    KV outputs
    ort       seqlens_k int32 [1] (seqlens),                  present_key_i/value_i [1, kvH, MAX, D]:
              total_sequence_length [] (total)
              (GroupQueryAttention, contrib ops)              bound to the past buffer, written in place
    portable  past_length int64 [] (past_length)              new_key_i/value_i [1, kvH, S, D]:
              (standard ops, static shapes: TensorRT)         the engine copies them into the buffer

S is static for the target's verify graph (K = γ + 1) and the draft's step graph (1), and
dynamic ("S") for the dynamic-length graphs (ORT flavour only). ``signature`` returns the
manifest's TensorSpecs and the ``GraphIO`` naming each tensor's role: the runtime reads
names from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from specdec.export import attention, portable
from specdec.manifest import GraphIO, TensorSpec

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16}


class _Wrapper(torch.nn.Module):
    """Runs an HF causal LM on S new tokens with the flavour's attention reading the buffers."""

    def __init__(self, model: torch.nn.Module, flavour: Flavour):
        super().__init__()
        self.model = model
        self.flavour = flavour

    def forward(self, input_ids, position_ids, scalars: list[torch.Tensor], past: list[torch.Tensor]):
        state = self.flavour.state(list(past[0::2]), list(past[1::2]), *scalars)
        with attention.call_state(state):
            out = self.model(input_ids=input_ids, position_ids=position_ids, past_key_values=attention.PassThroughCache(), use_cache=True)
        kv = []
        for i in range(self.model.config.num_hidden_layers):
            kv += self.flavour.kv_out(state, i)
        return (out.logits.float(), *kv)


@dataclass(frozen=True)
class Flavour:
    attn: str
    scalars: tuple[tuple[str, str, tuple, str], ...]  # (name, dtype, shape, GraphIO role) after input_ids, position_ids
    example: Callable[[int], list[torch.Tensor]]  # scalar values for tracing S = s new tokens after 2 rows
    state: Callable
    kv_out: Callable  # (state, layer) -> [key, value] outputs
    out_names: tuple[str, str]
    out_rows: Callable[[int, int | str], int | str]  # (MAX, S) -> rows of each KV output


FLAVOURS = {
    "ort": Flavour(
        attn=attention.ATTN_NAME,
        scalars=(("seqlens_k", "int32", (1,), "seqlens"), ("total_sequence_length", "int32", (), "total")),
        example=lambda s: [torch.tensor([s + 1], dtype=torch.int32), torch.tensor(s + 2, dtype=torch.int32)],
        state=attention._CallState,
        kv_out=lambda st, i: [st.present_k[i], st.present_v[i]],
        out_names=("present_key", "present_value"),
        out_rows=lambda max_seq, s: max_seq,
    ),
    "portable": Flavour(
        attn=portable.ATTN_NAME,
        scalars=(("past_length", "int64", (), "past_length"),),
        example=lambda s: [torch.tensor(2, dtype=torch.int64)],
        state=portable.PortableState,
        kv_out=lambda st, i: [st.new_k[i], st.new_v[i]],
        out_names=("new_key", "new_value"),
        out_rows=lambda max_seq, s: s,
    ),
}


def kv_specs(inputs: list, outputs: list, layers: int, dtype: str, kv_in: tuple, kv_out: tuple,
             out_names: tuple[str, str] = ("present_key", "present_value")) -> tuple[list, list]:  # fmt: skip
    """Append each layer's past K/V inputs (shape ``kv_in``) and present K/V outputs (``kv_out``)
    to ``inputs`` / ``outputs``; returns their (key, value) name pairs, past and present."""
    past = [(f"past_key_{i}", f"past_value_{i}") for i in range(layers)]
    present = [(f"{out_names[0]}_{i}", f"{out_names[1]}_{i}") for i in range(layers)]
    for (pk, pv), (nk, nv) in zip(past, present):
        inputs += [TensorSpec(pk, dtype, kv_in), TensorSpec(pv, dtype, kv_in)]
        outputs += [TensorSpec(nk, dtype, kv_out), TensorSpec(nv, dtype, kv_out)]
    return past, present


def signature(
    layers: int, kv_heads: int, head_dim: int, vocab: int, max_seq: int, tokens: int | None, dtype: str, flavour: str = "ort"
):
    """The graph's inputs and outputs as manifest TensorSpecs, and the role of each (GraphIO)."""
    fl = FLAVOURS[flavour]
    s = tokens if tokens is not None else "S"
    kv_in = (1, kv_heads, max_seq, head_dim)
    kv_out = (1, kv_heads, fl.out_rows(max_seq, s), head_dim)
    inputs = [TensorSpec("input_ids", "int64", (1, s)), TensorSpec("position_ids", "int64", (1, s))]
    inputs += [TensorSpec(name, dt, shape) for name, dt, shape, _ in fl.scalars]
    outputs = [TensorSpec("logits", "float32", (1, s, vocab))]
    past, present = kv_specs(inputs, outputs, layers, dtype, kv_in, kv_out, fl.out_names)
    io = GraphIO("input_ids", "position_ids", "logits", tuple(past), tuple(present), **{role: name for name, _, _, role in fl.scalars})
    return inputs, outputs, io


def export_decoder(
    model: torch.nn.Module,
    path: Path,
    tokens: int | None,
    max_seq: int,
    kv_heads: int,
    head_dim: int,
    dtype: str,
    flavour: str = "ort",
) -> tuple[list[TensorSpec], list[TensorSpec], GraphIO]:
    """Export ``model`` to ``path`` (+ ``path.data``) with S = ``tokens`` new tokens per call (None: dynamic)."""
    fl = FLAVOURS[flavour]
    cfg = model.config
    layers = cfg.num_hidden_layers
    inputs, outputs, io = signature(layers, kv_heads, head_dim, cfg.vocab_size, max_seq, tokens, dtype, flavour)
    example = 3 if tokens is None else tokens  # trace after 2 committed rows
    args = (
        torch.zeros(1, example, dtype=torch.long),
        torch.arange(example).view(1, example) + 2,
        fl.example(example),
        [torch.zeros(1, kv_heads, max_seq, head_dim, dtype=TORCH_DTYPES[dtype]) for _ in range(2 * layers)],
    )
    dynamic = None
    if tokens is None:
        s = torch.export.Dim("S", min=1, max=max_seq)
        dynamic = ({1: s}, {1: s}, [None] * len(fl.scalars), [None] * (2 * layers))
    attention.export_traced(_Wrapper(model, fl), args, path, inputs, outputs, config=cfg, attn=fl.attn, dynamic=dynamic)
    return inputs, outputs, io


def fix_tokens(dynamic: Path, path: Path, tokens: int, layers: int, kv_heads: int, head_dim: int, vocab: int, max_seq: int,
               dtype: str) -> tuple[list[TensorSpec], list[TensorSpec], GraphIO]:  # fmt: skip
    """Write ``path``: the ORT-flavour graph at ``dynamic`` with its dynamic token count S fixed
    to ``tokens`` on every input and output. Weights stay where ``dynamic``'s point (its external
    data, in the same folder); inner shapes are dropped for ONNX Runtime to infer again."""
    import onnx

    proto = onnx.load(str(dynamic), load_external_data=False)
    ids = next(v for v in proto.graph.input if v.name == "input_ids")
    symbol = ids.type.tensor_type.shape.dim[1].dim_param  # the exporter's name for S ("s0", "S", ...)
    fixed = 0
    for value in (*proto.graph.input, *proto.graph.output):
        for dim in value.type.tensor_type.shape.dim:
            if symbol and dim.dim_param == symbol:
                dim.dim_value = tokens  # clears dim_param (a oneof)
                fixed += 1
    if fixed < 3:  # input_ids, position_ids, logits at least
        raise ValueError(f"{dynamic.name}: expected a dynamic token dimension on input_ids, position_ids and logits, fixed {fixed}")
    del proto.graph.value_info[:]
    onnx.save_model(proto, str(path))
    return signature(layers, kv_heads, head_dim, vocab, max_seq, tokens, dtype, "ort")

"""Export one decoder graph: S new tokens per call over preallocated KV buffers.

Signature (batch 1; L layers; kvH KV heads; D head dim; MAX = max-seq-len):
    inputs   input_ids             int64   [1, S]
             position_ids          int64   [1, S]      past + 0..S-1
             seqlens_k             int32   [1]         past + S - 1
             total_sequence_length int32   []          past + S
             past_key_i/past_value_i  float [1, kvH, MAX, D]   i = 0..L-1
    outputs  logits                float32 [1, S, V]   every position, never last-only
             present_key_i/present_value_i  float [1, kvH, MAX, D]  (bind to the past buffer)

S is static for the target's verify graph (K = γ + 1) and the draft's step graph (1), and
dynamic ("S") for the prefill graphs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.export.attention import ATTN_NAME, CUSTOM_TRANSLATION, PassThroughCache, _CallState, call_state
from specdec.manifest import TensorSpec

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16}


class DecoderWrapper(torch.nn.Module):
    """Runs an HF causal LM on S new tokens, reading and writing KV through GroupQueryAttention."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.layers = model.config.num_hidden_layers

    def forward(self, input_ids, position_ids, seqlens_k, total_sequence_length, past: list[torch.Tensor]):
        state = _CallState(list(past[0::2]), list(past[1::2]), seqlens_k, total_sequence_length)
        with call_state(state):
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                past_key_values=PassThroughCache(),
                use_cache=True,
            )
        presents = []
        for i in range(self.layers):
            presents += [state.present_k[i], state.present_v[i]]
        return (out.logits.float(), *presents)


def signature(layers: int, kv_heads: int, head_dim: int, vocab: int, max_seq: int, tokens: int | None, dtype: str):
    """The graph's inputs and outputs as manifest TensorSpecs."""
    s = tokens if tokens is not None else "S"
    kv = (1, kv_heads, max_seq, head_dim)
    inputs = [
        TensorSpec("input_ids", "int64", (1, s)),
        TensorSpec("position_ids", "int64", (1, s)),
        TensorSpec("seqlens_k", "int32", (1,)),
        TensorSpec("total_sequence_length", "int32", ()),
    ]
    outputs = [TensorSpec("logits", "float32", (1, s, vocab))]
    for i in range(layers):
        inputs += [TensorSpec(f"past_key_{i}", dtype, kv), TensorSpec(f"past_value_{i}", dtype, kv)]
        outputs += [TensorSpec(f"present_key_{i}", dtype, kv), TensorSpec(f"present_value_{i}", dtype, kv)]
    return inputs, outputs


def export_decoder(
    model: torch.nn.Module, path: Path, tokens: int | None, max_seq: int, kv_heads: int, head_dim: int, dtype: str
) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Export ``model`` to ``path`` (+ ``path.data``) with S = ``tokens`` new tokens per call (None: dynamic)."""
    cfg = model.config
    layers = cfg.num_hidden_layers
    inputs, outputs = signature(layers, kv_heads, head_dim, cfg.vocab_size, max_seq, tokens, dtype)
    example = 3 if tokens is None else tokens  # trace with a non-empty past
    torch_dtype = TORCH_DTYPES[dtype]
    args = (
        torch.zeros(1, example, dtype=torch.long),
        torch.arange(example).view(1, example) + 2,
        torch.tensor([example + 1], dtype=torch.int32),
        torch.tensor(example + 2, dtype=torch.int32),
        [torch.zeros(1, kv_heads, max_seq, head_dim, dtype=torch_dtype) for _ in range(2 * layers)],
    )
    dynamic = None
    if tokens is None:
        s = torch.export.Dim("S", min=1, max=max_seq)
        dynamic = ({1: s}, {1: s}, None, None, [None] * (2 * layers))
    previous = cfg._attn_implementation
    cfg._attn_implementation = ATTN_NAME
    try:
        with torch.no_grad():
            program = torch.onnx.export(
                DecoderWrapper(model).eval(),
                args,
                dynamo=True,
                input_names=[t.name for t in inputs],
                output_names=[t.name for t in outputs],
                dynamic_shapes=dynamic,
                custom_translation_table=CUSTOM_TRANSLATION,
                optimize=True,
                verbose=False,
            )
    finally:
        cfg._attn_implementation = previous
    program.save(str(path), external_data=True)
    return inputs, outputs

"""Rotary embeddings made traceable the same way under every transformers version.

Static rotaries (default, linear, llama3, yarn: one inv_freq) compute cos/sin from the outer
product positions x inv_freq. transformers 4.57 writes it as a MatMul [B, D/2, 1] @ [B, 1, S],
5.x as a broadcast Mul; both give the same floats (one product per element), but only the MatMul
form is what onnxscript's cos/sin-cache fusion matches, and without it no RotaryEmbedding, no
constant cache and no rotary inside GroupQueryAttention (export/optimize.py). So every static
rotary gets the MatMul form (``matmul_rotary``).

Rotaries whose transformers forward branches on the call's positions are made per position:

LongRoPE (Phi-3/Phi-4's 128k variants, Phi-3.5) has two factor sets: ``short_factor`` for
sequences within ``original_max_position_embeddings`` and ``long_factor`` beyond. transformers
picks one set per forward call, from max(position_ids) + 1 (``dynamic_rope_update``): a Python
branch that tracing would freeze at the example's length. Decoding one token at a time, that
rule gives the token at position t the long factors exactly when t >= original_max; a verify
call of K tokens (or a batch of rows) must not decide by its largest position, or the output
would depend on γ and on the batch. So the exported rotary decides per position:

    inv_freq(t) = long_inv_freq  if t + 1 > original_max  else short_inv_freq

which equals transformers' one-token-at-a-time decoding everywhere. It differs from
transformers' one-shot forward over a prompt longer than original_max, which rotates the
prompt's early positions with the long factors too (docs/export.md).
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where the forwards run: families.py reads this module before any weights load
    import torch


def _per_position(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, S, D] for position_ids [B, S]: each position with its own factor set."""
    import torch

    pos = position_ids[:, :, None].float()  # [B, S, 1]
    short = pos * self.specdec_short[None, None, :]  # [B, S, D/2]
    long = pos * self.specdec_long[None, None, :]
    freqs = torch.where(pos + 1 > self.specdec_original_max, long, short)
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, S, D]
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def _outer_product(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, S, D] for position_ids [B, S] (Gemma 3 on 5.x: one module, a table per layer type)."""
    import torch

    prefix = f"{layer_type}_" if layer_type else ""
    inv_freq, scaling = getattr(self, prefix + "inv_freq"), getattr(self, prefix + "attention_scaling")
    inv = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)  # [B, D/2, 1]
    freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)  # [B, S, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, S, D]
    return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)


def _static(module: Any) -> bool:
    """A transformers rotary module with fixed frequencies (one per layer type, or one)."""
    kinds = getattr(module, "rope_type", None)
    kinds = set(kinds.values()) if isinstance(kinds, dict) else {kinds}
    return (type(module).__name__.endswith("RotaryEmbedding") and None not in kinds and not kinds & {"dynamic", "longrope"}
            and any(name == "inv_freq" or name.endswith("_inv_freq") for name, _ in module.named_buffers(recurse=False)))


def matmul_rotary(model: Any) -> int:
    """Give every static rotary module of ``model`` the MatMul form; returns how many."""
    done = 0
    for module in model.modules():
        if _static(module):
            module.forward = types.MethodType(_outer_product, module)
            done += 1
    return done


def for_export(model: Any) -> int:
    """Both rewrites of this module; returns how many rotary modules changed."""
    return matmul_rotary(model) + longrope_by_position(model)


def longrope_by_position(model: Any) -> int:
    """Give every LongRoPE rotary module of ``model`` the per-position forward; returns how many."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    done = 0
    for module in model.modules():
        if getattr(module, "rope_type", None) != "longrope" or not hasattr(module, "config"):
            continue
        cfg = module.config
        init = getattr(module, "rope_init_fn", None) or ROPE_INIT_FUNCTIONS["longrope"]  # 5.x: looked up per call
        params = getattr(cfg, "rope_parameters", None) or {}  # transformers 5.x keeps it there
        original = (getattr(cfg, "original_max_position_embeddings", None) or params.get("original_max_position_embeddings")
                    or cfg.max_position_embeddings)  # fmt: skip
        short, _ = init(cfg, None)
        long, _ = init(cfg, None, seq_len=original + 1)
        module.specdec_short, module.specdec_long = short.float(), long.float()
        module.specdec_original_max = float(original)
        module.forward = types.MethodType(_per_position, module)
        done += 1
    return done

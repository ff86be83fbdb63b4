"""Rotary embeddings whose transformers forward branches on the call's positions, made per position.

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
from typing import Any

import torch


def _per_position(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, S, D] for position_ids [B, S]: each position with its own factor set."""
    pos = position_ids[:, :, None].float()  # [B, S, 1]
    short = pos * self.specdec_short[None, None, :]  # [B, S, D/2]
    long = pos * self.specdec_long[None, None, :]
    freqs = torch.where(pos + 1 > self.specdec_original_max, long, short)
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, S, D]
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def longrope_by_position(model: Any) -> int:
    """Give every LongRoPE rotary module of ``model`` the per-position forward; returns how many."""
    done = 0
    for module in model.modules():
        if getattr(module, "rope_type", None) != "longrope" or not hasattr(module, "rope_init_fn"):
            continue
        cfg = module.config
        params = getattr(cfg, "rope_parameters", None) or {}  # transformers 5.x keeps it there
        original = (getattr(cfg, "original_max_position_embeddings", None) or params.get("original_max_position_embeddings")
                    or cfg.max_position_embeddings)  # fmt: skip
        short, _ = module.rope_init_fn(cfg, None)
        long, _ = module.rope_init_fn(cfg, None, seq_len=original + 1)
        module.specdec_short, module.specdec_long = short.float(), long.float()
        module.specdec_original_max = float(original)
        module.forward = types.MethodType(_per_position, module)
        done += 1
    return done

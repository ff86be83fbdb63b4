"""Standard-op attention over a fixed-size KV buffer: the portable flavour TensorRT builds from.

Every shape is static: the past is the whole preallocated buffer [1, kvH, MAX, D] and rows
at or beyond ``past_length`` are masked out, so one engine serves every context length.
The graph cannot write into its inputs, so it returns only the S new rows and the engine
copies them into the buffer (S x kvH x D values per layer, not the cache).

    q [1, H, S, D] -> [1, kvH, g*S, D]           (g = H / kvH query heads per KV head)
    scores = [q pastᵀ  masked j >= past_length  |  q newᵀ  causal]   [1, kvH, g*S, MAX + S]
    out    = softmax(scores) @ [past_v ; new_v]  -> [1, S, H, D]

Scores against the past and against the new rows are computed separately and never
concatenate the cache: only the small score matrix is concatenated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface

from specdec.export.attention import _active, _scaling

ATTN_NAME = "specdec_portable"


@dataclass
class PortableState:
    past_k: list[torch.Tensor]  # per layer [1, kvH, MAX, D]
    past_v: list[torch.Tensor]
    past_length: torch.Tensor  # int64 []: committed rows
    new_k: dict[int, torch.Tensor] = field(default_factory=dict)  # per layer [1, kvH, S, D]
    new_v: dict[int, torch.Tensor] = field(default_factory=dict)


def portable_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, softcap=None,
                       **kwargs):  # fmt: skip
    """query [1, H, S, D], key/value [1, kvH, S, D] (new rows, after rotary) -> [1, S, H, D]."""
    state = _active[-1]
    layer = module.layer_idx
    _, h, s, d = query.shape
    kvh = key.shape[1]
    g = h // kvh
    past_k, past_v = state.past_k[layer], state.past_v[layer]
    state.new_k[layer], state.new_v[layer] = key, value
    scale = _scaling(module, d, scaling)
    q = query.reshape(1, kvh, g * s, d)  # head kv*g + j reads KV head kv, as repeat_kv does

    pos = state.past_length + torch.arange(s)  # [S] absolute positions of the new rows
    j = torch.arange(past_k.shape[2])  # [MAX]
    past_ok = j[None, :] < state.past_length  # [1, MAX]
    new_ok = torch.arange(s)[None, :] <= torch.arange(s)[:, None]  # [S, S] causal
    if sliding_window:  # the last `sliding_window` rows, itself included (transformers' masks)
        past_ok = past_ok & (pos[:, None] - j[None, :] < sliding_window)  # [S, MAX]
        new_ok = new_ok & (torch.arange(s)[:, None] - torch.arange(s)[None, :] < sliding_window)
    past_ok = past_ok.expand(s, -1).repeat(g, 1)  # [g*S, MAX]
    new_ok = new_ok.repeat(g, 1)  # [g*S, S]
    low = torch.finfo(query.dtype).min
    s_past, s_new = (q @ past_k.transpose(2, 3)) * scale, (q @ key.transpose(2, 3)) * scale
    if softcap:  # Gemma 2: scores -> softcap * tanh(scores / softcap)
        s_past, s_new = torch.tanh(s_past / softcap) * softcap, torch.tanh(s_new / softcap) * softcap
    s_past = torch.where(past_ok, s_past, low)
    s_new = torch.where(new_ok, s_new, low)
    w = torch.softmax(torch.cat([s_past, s_new], dim=-1).float(), dim=-1).to(query.dtype)
    split = past_k.shape[2]
    out = w[..., :split] @ past_v + w[..., split:] @ value  # [1, kvH, g*S, D]
    return out.reshape(1, h, s, d).transpose(1, 2), None


AttentionInterface.register(ATTN_NAME, portable_attention)

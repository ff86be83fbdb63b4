"""Quantized bundles side by side on held-out chat and coding requests: is greedy speculative
output (each bundle's default drafter) the bundle's autoregressive output, token for token, on
every request; and both decoding speeds, interleaved per request across the bundles.

    python tools/bench_exact_quantized.py --bundle "int8 blocks=B8" --bundle "int8 nbits=B8N" \\
        --chat 12 --code 8 --tokens 96 --rounds 2 --out docs/bench/kernels

Built for `--kernel blocks` against `--kernel nbits` (docs/quantization.md, Kernels).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdec.bench.corpus import chat_prompts  # noqa: E402
from specdec.bench.report import write_results  # noqa: E402
from specdec.runtime.decoder import SpeculativeDecoder  # noqa: E402


def first_difference(a: list[int], b: list[int]) -> int | None:
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return i if i is not None or len(a) == len(b) else min(len(a), len(b))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", action="append", required=True, help="LABEL=FOLDER, repeatable")
    ap.add_argument("--chat", type=int, default=12, help="held-out everyday requests")
    ap.add_argument("--code", type=int, default=8, help="held-out coding requests")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()

    decs = {label: SpeculativeDecoder.load(folder) for label, folder in (b.split("=", 1) for b in a.bundle)}
    first = next(iter(decs.values()))
    rows = {label: {"label": label, "drafter": d.manifest.drafter, "identical": 0, "requests": 0, "first_differences": [],
                    "ar_tokens": 0, "ar_s": 0.0, "spec_tokens": 0, "spec_s": 0.0} for label, d in decs.items()}  # fmt: skip
    for kind, count in (("chat", a.chat), ("code", a.code)):
        for prompt in chat_prompts(Path(first.bundle), first.manifest, first.codec, kind, count):
            for rnd in range(a.rounds):
                for label, dec in decs.items():
                    r = rows[label]
                    t0 = time.perf_counter()
                    ar = dec.generate(prompt, max_new_tokens=a.tokens, gamma=0).tokens
                    t1 = time.perf_counter()
                    spec = dec.generate(prompt, max_new_tokens=a.tokens).tokens
                    t2 = time.perf_counter()
                    r["ar_tokens"], r["ar_s"] = r["ar_tokens"] + len(ar), r["ar_s"] + t1 - t0
                    r["spec_tokens"], r["spec_s"] = r["spec_tokens"] + len(spec), r["spec_s"] + t2 - t1
                    if rnd == 0:
                        i = first_difference(spec, ar)
                        r["requests"] += 1
                        r["identical"] += i is None
                        r["first_differences"] += [] if i is None else [i]
    lines = ["| bundle | speculative = autoregressive | autoregressive tok/s | speculative tok/s | × own |", "|---|---|---:|---:|---:|"]
    for r in rows.values():
        r["ar_tok_s"], r["spec_tok_s"] = r["ar_tokens"] / r["ar_s"], r["spec_tokens"] / r["spec_s"]
        r["speedup"] = r["spec_tok_s"] / r["ar_tok_s"]
        lines.append(f"| {r['label']} | {r['identical']} of {r['requests']} | {r['ar_tok_s']:.1f} | {r['spec_tok_s']:.1f} | {r['speedup']:.2f} |")
    print("\n".join(lines))
    write_results(a.out, "\n".join(lines) + "\n", {"tokens": a.tokens, "rounds": a.rounds, "chat": a.chat, "code": a.code, "rows": list(rows.values())})
    return 0


if __name__ == "__main__":
    sys.exit(main())

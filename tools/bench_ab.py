#!/usr/bin/env python3
"""Two specdec trees side by side: batch-1 tok/s through SpeculativeDecoder and aggregate tok/s
through BatchEngine, interleaved round by round (old, new, old, new, ...) in fresh processes.

    python tools/bench_ab.py BUNDLE --old DIR [--rounds 5] [--out docs/bench/refactor]

``--old DIR``: a folder whose ``specdec`` package is the other tree (e.g. a ``git worktree`` of
the previous commit with ``specdec/``'s subpackages linked in); the child runs with it first on
``PYTHONPATH``. Each round runs each tree once: the decoder on 3 prompts x 128 tokens (greedy
and T=1, γ = the bundle's, the draft model), then the batched engine on 8 requests x 96 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, time
from specdec.runtime import SpeculativeDecoder
from specdec.runtime.batch import BatchEngine

bundle = sys.argv[1]
prompts = ["def parse_args(argv):\n", 'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n',
           "import os\nimport sys\n\n\ndef main():\n"]
out = {}
dec = SpeculativeDecoder.load(bundle)
dec.generate(prompts[0], max_new_tokens=16)  # warm
for name, kw in (("decoder T=0", {}), ("decoder T=1", {"temperature": 1.0})):
    tokens = seconds = 0.0
    for i, p in enumerate(prompts):
        s = dec.generate(p, max_new_tokens=128, ignore_eos=True, seed=i, **kw).stats
        tokens += s.new_tokens
        seconds += s.total_seconds - s.prefill_seconds
    out[name] = tokens / seconds
with BatchEngine(bundle) as engine:
    engine.generate_many(prompts, max_new_tokens=16)  # warm
    t0 = time.perf_counter()
    res = engine.generate_many([prompts[i % 3] for i in range(8)], max_new_tokens=96, ignore_eos=True)
    out["batch x8 T=0"] = sum(len(r.tokens) for r in res) / (time.perf_counter() - t0)
print(json.dumps(out))
"""


def run(bundle: Path, pythonpath: str | None) -> dict[str, float]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    done = subprocess.run([sys.executable, "-c", CHILD, str(bundle)], capture_output=True, text=True, env=env, cwd="/", timeout=900)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--old", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for r in range(args.rounds):
        for tree, path in (("old", str(args.old)), ("new", None)):
            runs[tree].append(run(args.bundle, path))
            print(f"round {r + 1} {tree}: " + ", ".join(f"{k} {v:.1f}" for k, v in runs[tree][-1].items()), flush=True)
    rows = []
    for key in runs["new"][0]:
        old = statistics.median(x[key] for x in runs["old"])
        new = statistics.median(x[key] for x in runs["new"])
        rows.append({"mode": key, "old_tok_s": old, "new_tok_s": new, "ratio": new / old})
    print("| mode | old tok/s | new tok/s | new / old |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['mode']} | {row['old_tok_s']:.1f} | {row['new_tok_s']:.1f} | {row['ratio']:.3f} |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"bundle": str(args.bundle), "rounds": args.rounds, "rows": rows, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()

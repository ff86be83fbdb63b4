#!/usr/bin/env python3
"""Two specdec trees side by side: batch-1 tok/s through SpeculativeDecoder and aggregate tok/s
through BatchEngine, alternated request by request between two long-lived worker processes.

    python tools/bench_ab.py BUNDLE --old DIR [--rounds 30] [--out docs/bench/engine-core]

``--old-bundle PATH``: the old tree's own bundle (an export change: each tree's export of the
same models), else both load BUNDLE. ``--old DIR``: a folder whose ``specdec`` package is the other tree (e.g. a ``git worktree`` of
the previous commit with ``specdec/``'s subpackages linked in); its worker runs with it first on
``PYTHONPATH``. Each worker loads the bundle once and warms up; then each round sends every
measurement to both workers in turn (the order flips every round), one at a time, so both see
the same machine: the decoder on one prompt x 128 tokens at T=0 and at T=1 (γ = the bundle's,
the draft model), and the batched engine on 8 requests x 96 tokens (T=0). Reported: the
median tok/s of each and the median of the per-round new/old ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = r'''
import json, sys, time
from specdec.runtime import SpeculativeDecoder
from specdec.runtime.batch import BatchEngine

dec = SpeculativeDecoder.load(sys.argv[1])
engine = BatchEngine(sys.argv[1])
prompts = ["def parse_args(argv):\n", "import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n"]
dec.generate(prompts[0], max_new_tokens=16)
engine.generate_many(prompts, max_new_tokens=16)
print("ready", flush=True)
for line in sys.stdin:
    mode = line.strip()
    if mode == "batch":
        t0 = time.perf_counter()
        res = engine.generate_many([prompts[i % 3] for i in range(8)], max_new_tokens=96, ignore_eos=True)
        print(json.dumps(sum(len(r.tokens) for r in res) / (time.perf_counter() - t0)), flush=True)
    else:
        s = dec.generate(prompts[0], max_new_tokens=128, ignore_eos=True, temperature=float(mode), seed=1).stats
        print(json.dumps(s.new_tokens / (s.total_seconds - s.prefill_seconds)), flush=True)
engine.close()
'''
MODES = {"decoder T=0": "0", "decoder T=1": "1", "batch x8 T=0": "batch"}


def worker(bundle: Path, pythonpath: str | None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=pythonpath) if pythonpath else dict(os.environ)
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(bundle.resolve())], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, cwd="/")  # fmt: skip
    if proc.stdout.readline().strip() != "ready":
        raise SystemExit(f"worker ({pythonpath or 'this tree'}) failed to start")
    return proc


def ask(proc: subprocess.Popen, mode: str) -> float:
    proc.stdin.write(mode + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--old", type=Path, required=True)
    ap.add_argument("--old-bundle", type=Path, default=None, help="the old tree's export of the same models (default: BUNDLE)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    procs = {"old": worker(args.old_bundle or args.bundle, str(args.old)), "new": worker(args.bundle, None)}
    runs = {(tree, mode): [] for tree in procs for mode in MODES}
    try:
        for r in range(args.rounds):
            for mode, cmd in MODES.items():
                for tree in ("old", "new") if r % 2 else ("new", "old"):
                    runs[tree, mode].append(ask(procs[tree], cmd))
    finally:
        for p in procs.values():
            p.kill()
    rows = []
    for mode in MODES:
        old, new = runs["old", mode], runs["new", mode]
        rows.append({"mode": mode, "old_tok_s": statistics.median(old), "new_tok_s": statistics.median(new),
                     "ratio": statistics.median(b / a for a, b in zip(old, new))})  # fmt: skip
    print("| mode | old tok/s | new tok/s | new / old (median of rounds) |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['mode']} | {row['old_tok_s']:.1f} | {row['new_tok_s']:.1f} | {row['ratio']:.3f} |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        raw = {f"{tree} {mode}": v for (tree, mode), v in runs.items()}
        (args.out / "results.json").write_text(json.dumps({"bundle": str(args.bundle), "old_bundle": str(args.old_bundle or args.bundle), "rounds": args.rounds, "rows": rows, "runs": raw}, indent=1))


if __name__ == "__main__":
    main()

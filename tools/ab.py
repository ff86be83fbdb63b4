"""This tree against another on one bundle: the same outputs, and the speed side by side.

    python tools/ab.py BUNDLE --old DIR [--old-bundle B] [--rounds 30] [--out docs/bench/engine-core]

What a refactor must leave alone, checked in one run. ``--old DIR`` is a folder whose ``specdec``
package is the other tree (e.g. ``git worktree add /tmp/old HEAD~1`` with ``specdec/``'s
subpackages linked in, as an editable install lays them out); its worker runs with it first on
``PYTHONPATH``. ``--old-bundle``: the old tree's own export of the same models (an export
change), else both load BUNDLE.

- **Outputs** (off with ``--no-outputs``): each worker decodes every drafter its tree registers
  that the bundle can run x
  {greedy, seeded T=1, seeded top-k/top-p} x γ in {0, 2, 4} on three prompts, through
  ``SpeculativeDecoder`` and (unless ``--no-batch``) ``BatchEngine`` with all prompts in flight;
  every case both trees know must give the same tokens, or the tool exits 1 naming them.
  Adaptive γ is left out: its choices follow measured time.
- **Speed**: each round sends every measurement to both workers in turn, the order reversed
  every other round (``specdec.commands.bench.sweep.interleaved``): the decoder on one prompt x 128 tokens at T=0 and T=1 (the bundle's γ, the draft
  model) and the batched engine on 8 requests x 96 tokens (T=0). Reported: the median tok/s of
  each and the median of the per-round new/old ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from specdec.commands.bench.report import write_results
from specdec.rounds import interleaved

WORKER = r'''
import json, sys, time
from specdec.runtime import SpeculativeDecoder
from specdec.runtime.batch import BatchEngine
from specdec.errors import SpecDecError
from specdec.runtime.drafters import DRAFTERS

bundle = sys.argv[1]
PROMPTS = ["def parse_args(argv):\n", 'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n',
           "import os\nimport sys\n\n\ndef main():\n    for name in os.listdir("]
SOURCES = ["def add(a, b):\n    return a + b\n", "def first(xs):\n    for x in xs:\n        return x\n    return None\n"]
SETTINGS = {"greedy": {}, "t1": {"temperature": 1.0}, "topkp": {"temperature": 0.8, "top_k": 20, "top_p": 0.9}}


def record(tokens, batch):
    out = {}
    prompts = SOURCES if SpeculativeDecoder.load(bundle, drafter="lookup").manifest.seq2seq else PROMPTS
    for drafter in DRAFTERS:
        try:
            dec = SpeculativeDecoder.load(bundle, drafter=drafter)
        except SpecDecError:  # the bundle lacks what this drafter needs (a tree graph, a feature head)
            continue
        cases = [(name, kw, g) for name, kw in SETTINGS.items() for g in (0, 2, 4)]
        for name, kw, g in cases:
            for i, p in enumerate(prompts):
                out[f"decoder/{drafter}/{name}/g{g}/p{i}"] = dec.generate(p, max_new_tokens=tokens, gamma=g, seed=100 + i, ignore_eos=True, **kw).tokens
        if batch:
            with BatchEngine(bundle, drafter=drafter) as engine:
                for name, kw, g in cases:
                    hs = [engine.submit(p, max_new_tokens=tokens, gamma=g, seed=100 + i, ignore_eos=True, **kw) for i, p in enumerate(prompts)]
                    out.update({f"batch/{drafter}/{name}/g{g}/p{i}": h.result(timeout=300).tokens for i, h in enumerate(hs)})
    return out


dec, engine = SpeculativeDecoder.load(bundle), None
print("ready", flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "record":
        print(json.dumps(record(int(args[0]), args[1] == "1")), flush=True)
    elif cmd == "batch":
        if engine is None:
            engine = BatchEngine(bundle)
            engine.generate_many(PROMPTS, max_new_tokens=16)
        t0 = time.perf_counter()
        res = engine.generate_many([PROMPTS[i % 3] for i in range(8)], max_new_tokens=96, ignore_eos=True)
        print(json.dumps(sum(len(r.tokens) for r in res) / (time.perf_counter() - t0)), flush=True)
    else:
        s = dec.generate(PROMPTS[0], max_new_tokens=128, ignore_eos=True, temperature=float(cmd), seed=1).stats
        print(json.dumps(s.new_tokens / (s.total_seconds - s.prefill_seconds)), flush=True)
'''
MODES = {"decoder T=0": "0", "decoder T=1": "1", "batch x8 T=0": "batch"}


class Tree:
    """One tree's long-lived worker process (its ``specdec`` first on PYTHONPATH when given)."""

    def __init__(self, bundle: Path, pythonpath: Path | None):
        env = dict(os.environ, PYTHONPATH=str(pythonpath.resolve())) if pythonpath else dict(os.environ)
        self.name = str(pythonpath or "this tree")
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, str(bundle.resolve())], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, cwd="/")  # fmt: skip
        if self.proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"the worker of {self.name} failed to start (its error is above)")

    def ask(self, cmd: str):
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the worker of {self.name} died on {cmd!r} (its error is above)")
        return json.loads(line)

    def close(self) -> None:
        self.proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--old", type=Path, required=True, help="a folder whose specdec package is the other tree")
    ap.add_argument("--old-bundle", type=Path, default=None, help="the old tree's export of the same models [default: BUNDLE]")
    ap.add_argument("--rounds", type=int, default=30, help="speed rounds (0: outputs only)")
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per output case")
    ap.add_argument("--no-outputs", action="store_true", help="speed only")
    ap.add_argument("--no-batch", action="store_true", help="outputs through SpeculativeDecoder only (a tree whose BatchEngine cannot run the bundle)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    trees = {"old": Tree(a.old_bundle or a.bundle, a.old), "new": Tree(a.bundle, None)}
    runs = {(tree, mode): [] for tree in trees for mode in MODES}
    try:
        differ, cases = [], 0
        if not a.no_outputs:
            old, new = (trees[t].ask(f"record {a.tokens} {0 if a.no_batch else 1}") for t in ("old", "new"))
            shared = sorted(set(old) & set(new))
            differ, cases = [k for k in shared if old[k] != new[k]], len(shared)
            print(f"outputs: {cases} cases both trees decode, {len(differ)} differ; only new: {len(set(new) - set(old))}", file=sys.stderr)
        for _, (mode, tree) in interleaved([(mode, tree) for mode in MODES for tree in ("new", "old")], a.rounds):
            runs[tree, mode].append(trees[tree].ask(MODES[mode]))
    finally:
        for t in trees.values():
            t.close()
    rows = [{"mode": mode, "old_tok_s": statistics.median(runs["old", mode]), "new_tok_s": statistics.median(runs["new", mode]),
             "ratio": statistics.median(y / x for x, y in zip(runs["old", mode], runs["new", mode]))}
            for mode in MODES if a.rounds]  # fmt: skip
    md = (f"bundle {a.bundle} (old tree: {a.old_bundle or a.bundle}); outputs: {cases} cases compared, {len(differ)} differ"
          + "".join(f"\n- DIFFERS {k}" for k in differ) + "\n\n| mode | old tok/s | new tok/s | new / old (median of rounds) |\n|---|---:|---:|---:|\n"
          + "".join(f"| {r['mode']} | {r['old_tok_s']:.1f} | {r['new_tok_s']:.1f} | {r['ratio']:.3f} |\n" for r in rows))
    print(md)
    write_results(a.out, md, {"bundle": str(a.bundle), "old_bundle": str(a.old_bundle or a.bundle), "rounds": a.rounds, "rows": rows,
                              "outputs": {"cases": cases, "differ": differ}, "runs": {f"{t} {m}": v for (t, m), v in runs.items()}})
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

"""Record what a bundle decodes, to check that a refactor changes nothing for users.

Every registered drafter x {greedy, seeded T=1, seeded top-k/top-p} x gamma in {0, 2, 4}, through
``SpeculativeDecoder`` (one request at a time) and, for a batched bundle, through ``BatchEngine``
(all prompts in flight together; ``--no-batch`` for a tree whose BatchEngine cannot run the
bundle or drafter). Adaptive gamma is left out: its choices follow measured time.

    python tools/record_outputs.py BUNDLE --out before.json     # on the old code
    python tools/record_outputs.py BUNDLE --out after.json --compare before.json

``--compare`` exits 1 naming each case whose tokens differ.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdec.runtime import SpeculativeDecoder
from specdec.runtime.batch import BatchEngine
from specdec.runtime.drafters import DRAFTERS

SETTINGS = {"greedy": {}, "t1": {"temperature": 1.0}, "topkp": {"temperature": 0.8, "top_k": 20, "top_p": 0.9}}
GAMMAS = (0, 2, 4)
PROMPTS = [
    "def parse_args(argv):\n",
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n',
    "import os\nimport sys\n\n\ndef main():\n    for name in os.listdir(",
]
SEQ2SEQ_SOURCES = ["def add(a, b):\n    return a + b\n", "def first(xs):\n    for x in xs:\n        return x\n    return None\n"]


def record(bundle: Path, tokens: int, batch: bool = True) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    probe = SpeculativeDecoder.load(bundle, drafter="lookup")
    prompts = SEQ2SEQ_SOURCES if probe.manifest.seq2seq else PROMPTS
    for drafter in DRAFTERS:
        dec = SpeculativeDecoder.load(bundle, drafter=drafter)
        for name, kw in SETTINGS.items():
            for gamma in GAMMAS:
                for i, prompt in enumerate(prompts):
                    res = dec.generate(prompt, max_new_tokens=tokens, gamma=gamma, seed=100 + i, ignore_eos=True, **kw)
                    out[f"decoder/{drafter}/{name}/g{gamma}/p{i}"] = res.tokens
        if not batch:
            continue
        with BatchEngine(bundle, drafter=drafter) as engine:
            for name, kw in SETTINGS.items():
                for gamma in GAMMAS:
                    handles = [engine.submit(p, max_new_tokens=tokens, gamma=gamma, seed=100 + i, ignore_eos=True, **kw) for i, p in enumerate(prompts)]
                    for i, h in enumerate(handles):
                        out[f"batch/{drafter}/{name}/g{gamma}/p{i}"] = h.result(timeout=300).tokens
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--compare", type=Path, help="an earlier recording: exit 1 if any shared case differs")
    ap.add_argument("--no-batch", action="store_true", help="record SpeculativeDecoder only")
    args = ap.parse_args()
    got = record(args.bundle, args.tokens, not args.no_batch)
    args.out.write_text(json.dumps(got, indent=0))
    print(f"{len(got)} cases -> {args.out}")
    if not args.compare:
        return 0
    want = json.loads(args.compare.read_text())
    shared = sorted(set(want) & set(got))
    bad = [k for k in shared if want[k] != got[k]]
    print(f"compared {len(shared)} shared cases: {len(bad)} differ; new cases {len(set(got) - set(want))}")
    for k in bad:
        print(f"  DIFFERS {k}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

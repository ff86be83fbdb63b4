#!/usr/bin/env python3
"""Tokens per target call: prompt lookup as a chain against prompt lookup as a tree (issue 28).

Decoding is greedy, so what a drafter gets accepted is fixed by the target's own greedy
continuation. This decodes each prompt once with the bundle's target alone (γ = 0), then replays
the decoding and counts, per target call:
- the chain: ``LookupDrafter`` (what ``--drafter lookup`` proposes, γ tokens);
- the tree: ``runtime.tree.lookup_tree``, N nodes, depth D, walked by ``verify_tree_greedy``.
A call yields accepted + 1 tokens. The result is the acceptance side of the trade; the cost
side is ``tools/bench_tree_cost.py``'s, so the speedup written here is a projection from two
measurements: tokens per call / (call cost / 1-token cost), with the lookup's own cost (µs)
left out. It is not an end-to-end run: the tree drafter is not wired into decoding yet.

    python tools/bench_lookup_tree.py BUNDLE --cost docs/bench/tree/demo.json --out docs/bench/tree/lookup-demo.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def replay_chain(full: np.ndarray, start: int, gamma: int) -> list[int]:
    """Tokens per call of the chain lookup drafter over the greedy sequence ``full``."""
    from specdec.runtime.drafters import LookupDrafter
    from specdec.runtime.sampling import GREEDY

    drafter, out, L = LookupDrafter(), [], start
    seq = np.zeros(len(full) + gamma + 1, dtype=np.int64)
    while L < len(full):
        seq[:L] = full[:L]
        k = drafter.propose(seq, L, gamma, GREEDY, None, None)
        n = 0
        while n < k and L + n < len(full) and seq[L + n] == full[L + n]:
            n += 1
        out.append(n + 1)
        L += n + 1
    return out


def replay_tree(full: np.ndarray, start: int, nodes: int, depth: int) -> list[int]:
    from specdec.runtime.tree import depths, lookup_tree, verify_tree_greedy

    out, L = [], start
    while L < len(full):
        tokens, parents, _ = lookup_tree(full, L, nodes, depth)
        level = depths(parents)
        rows = len(tokens) + 1
        logits = np.zeros((rows, int(full.max()) + 1))  # the greedy target as one-hot logits: row 0 the root
        for r in range(rows):
            pos = L + (0 if r == 0 else level[r - 1])
            if pos < len(full):
                logits[r, full[pos]] = 1.0
        v = verify_tree_greedy(np.array(tokens), np.array(parents), logits) if tokens else None
        n = len(v.path) if v else 0
        out.append(n + 1)
        L += n + 1
    return out



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--cost", type=Path, required=True, help="tools/bench_tree_cost.py's results for the same target")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from specdec.bench.corpus import prompts
    from specdec.runtime import SpeculativeDecoder

    dec = SpeculativeDecoder.load(args.bundle)
    cost = {r["nodes"]: r["vs_one_token"] for r in json.loads(args.cost.read_text())["rows"] if r["graph"].startswith("tree")}
    seqs = []
    for p in prompts("code", dec.codec.encode, args.prompts, args.prompt_tokens):
        res = dec.generate(p, max_new_tokens=args.tokens, gamma=0, ignore_eos=True)
        seqs.append((np.array(list(p) + res.tokens), len(p)))
    gamma = dec.manifest.gamma
    configs = [("chain", gamma + 1, gamma)] + [("tree", n, d) for n in (4, 8, 16, 32) for d in (4, 8) if n in cost]
    rows = []
    for kind, nodes, depth in configs:
        per_call = []
        for full, start in seqs:
            per_call += replay_chain(full, start, depth) if kind == "chain" else replay_tree(full, start, nodes, depth)
        mean = float(np.mean(per_call))
        c = cost.get(nodes) if kind == "tree" else cost.get(4)  # a K = γ + 1 chain verify, as the 4-node tree's cost (the closest measured)
        rows.append({"drafter": f"lookup {kind}", "nodes": nodes, "depth": depth, "tokens_per_call": mean, "call_cost": c,
                     "projected_speedup": mean / c if c else None})  # fmt: skip
        print(f"{kind:5} nodes {nodes:>2} depth {depth}: {mean:.2f} tokens per call, call cost {c:.2f}x -> {mean / c:.2f}x", flush=True)
    result = {"bundle": str(args.bundle), "prompts": args.prompts, "new_tokens": args.tokens, "cost_file": str(args.cost), "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

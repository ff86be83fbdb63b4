#!/usr/bin/env python3
"""What the feature head's draw over its draft vocabulary saves at T > 0, in situ.

A head with a draft vocabulary (``--draft-vocab``) gives every other token the logit NEVER, and
the runtime draws over its V' tokens alone (``sampling.draw_within``: the same law). This tool
decodes held-out chat requests at T = 1 with the bundle's feature drafter in interleaved rounds,
one arm drawing over the draft vocabulary and the other over the full row (the draw of before),
and reports each arm's tok/s and accepted drafts per drafted token (the same in both arms: the
law is the same, and so are the seeded draws):

    python tools/bench_draft_draw.py B --drafter feature-lookup --rounds 4 --out docs/bench/draft-draw/gemma-feature-lookup
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--drafter", default="feature-lookup", help="feature, feature-lookup or feature-tree")
    ap.add_argument("--kind", default="chat", help="held-out requests: chat or code")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None, help="a folder for results.json")
    args = ap.parse_args()

    from specdec.bench.corpus import chat_prompts
    from specdec.runtime import proposers
    from specdec.runtime.decoder import SpeculativeDecoder
    from specdec.runtime.sampling import draw

    within = proposers.FeatureHead.draw

    def full_row(self, logits, r, q):
        return draw(logits, r.req.sampling, r.rng, q)

    dec = SpeculativeDecoder.load(args.bundle, drafter=args.drafter)
    prompts = chat_prompts(args.bundle, dec.manifest, dec.codec, args.kind, args.prompts)
    arms = {"full_row": full_row, "draft_vocab": within}
    speed: dict[str, list[float]] = {a: [] for a in arms}
    accepted: dict[str, list[float]] = {a: [] for a in arms}

    def run(arm: str) -> tuple[float, float]:
        proposers.FeatureHead.draw = arms[arm]
        tokens = acc = drafted = 0
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            res = dec.generate(p, max_new_tokens=args.tokens, temperature=1.0, seed=i, ignore_eos=True)
            tokens, acc, drafted = tokens + len(res.tokens), acc + res.stats.accepted, drafted + res.stats.drafted
        return tokens / (time.perf_counter() - t0), acc / max(drafted, 1)

    run("draft_vocab")  # warm-up
    for rnd in range(args.rounds):
        for arm in list(arms) if rnd % 2 == 0 else list(arms)[::-1]:
            s, a = run(arm)
            speed[arm].append(round(s, 2))
            accepted[arm].append(round(a, 4))
    from specdec.bench.report import write_results

    med = {a: statistics.median(v) for a, v in speed.items()}
    out = {"bundle": str(args.bundle), "drafter": args.drafter, "kind": args.kind, "tok_s": speed, "median_tok_s": med,
           "ratio": round(med["draft_vocab"] / med["full_row"], 3), "accepted_per_drafted": accepted,
           "config": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
    print(json.dumps(out, indent=1))
    write_results(args.out, None, out)


if __name__ == "__main__":
    main()

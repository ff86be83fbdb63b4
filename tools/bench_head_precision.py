#!/usr/bin/env python3
"""Two bundles of one target, differing only in their feature head, side by side in one process:
each prompt decoded autoregressively and with the default drafter on each bundle, the
configurations interleaved per prompt (the order turned each round), so that the machine's
drift between runs does not decide. Used to pick a head's default precision (export/pipeline.py
HEAD_DEFAULT): the same head in float32 and in int8 blocks. Times are whole requests, prefill
included (the same prompts for every configuration).

    python tools/bench_head_precision.py A B --corpus chat --prompts 12 --tokens 128 --out docs/bench/head-precision/chat.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundles", type=Path, nargs=2)
    ap.add_argument("--corpus", default="chat", choices=("chat", "code"), help="held-out everyday (chat) or coding (code) requests")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from specdec.bench.corpus import chat_prompts
    from specdec.bench.report import provenance
    from specdec.manifest import load_manifest
    from specdec.runtime import SpeculativeDecoder

    decs = {str(b): SpeculativeDecoder.load(b) for b in args.bundles}
    for b, d in decs.items():
        if d.manifest.head is None:
            raise SystemExit(f"{b}: no feature head; export both bundles from a draft folder with one (head_config.json)")
    first = next(iter(decs.values()))
    prompts = chat_prompts(args.bundles[0], load_manifest(args.bundles[0]), first.codec, args.corpus, args.prompts)
    configs = [(b, g) for b in decs for g in (0, None)]  # (bundle, γ): 0 autoregressive, None the default drafter's
    rows = []
    for temp in (float(t) for t in args.temperatures.split(",")):
        took = {c: [] for c in configs}
        made = {c: 0 for c in configs}
        kept = {c: [0, 0] for c in configs}  # (drafted, accepted)
        for r in range(args.rounds):
            for i, p in enumerate(prompts):
                order = configs if (i + r) % 2 == 0 else configs[::-1]
                for b, g in order:
                    fields = dict(max_new_tokens=args.tokens, temperature=temp, seed=i)
                    if g == 0:
                        fields["gamma"] = 0
                    t0 = time.perf_counter()
                    res = decs[b].generate(p, **fields)
                    took[(b, g)].append(time.perf_counter() - t0)
                    made[(b, g)] += len(res.tokens)
                    kept[(b, g)][0] += res.stats.drafted
                    kept[(b, g)][1] += res.stats.accepted
        for b, g in configs:
            tok_s = made[(b, g)] / sum(took[(b, g)])
            ar = made[(b, 0)] / sum(took[(b, 0)])
            rows.append({"bundle": b, "head": decs[b].manifest.head.quantization or "float32", "T": temp,
                         "drafter": "autoregressive" if g == 0 else decs[b].drafter_spec, "tok_s": round(tok_s, 1),
                         "vs_own_ar": round(tok_s / ar, 3), "accepted_per_drafted": round(kept[(b, g)][1] / kept[(b, g)][0], 3) if kept[(b, g)][0] else None})
            print(rows[-1], flush=True)
    out = {"provenance": {**provenance(), "command": " ".join(["python", "tools/bench_head_precision.py", *sys.argv[1:]])},
           "corpus": args.corpus, "prompts": len(prompts), "tokens": args.tokens, "rounds": args.rounds, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

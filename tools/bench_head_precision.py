#!/usr/bin/env python3
"""Two bundles of one target, differing only in their feature head (its precision, or its training), side by side in one process:
each prompt decoded autoregressively and with the default drafter on each bundle, interleaved
as ``specdec bench`` interleaves its configurations (``specdec.bench.sweep.run``), so that the
machine's drift between runs does not decide. Used to pick a head's default precision (export/pipeline.py
HEAD_DEFAULT): the same head in float32 and in int8 blocks. α and the draft cost c per drafted
token are read as ``specdec bench`` reads them.

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
    from specdec.bench.sweep import Config, alpha_mle, run
    from specdec.bench.report import provenance
    from specdec.manifest import load_manifest
    from specdec.runtime import SpeculativeDecoder

    decs = {str(b): SpeculativeDecoder.load(b) for b in args.bundles}
    for b, d in decs.items():
        if d.manifest.head is None:
            raise SystemExit(f"{b}: no feature head; export both bundles from a draft folder with one (head_config.json)")
    first = next(iter(decs.values()))
    prompts = chat_prompts(args.bundles[0], load_manifest(args.bundles[0]), first.codec, args.corpus, args.prompts)
    # specdec bench's sweep, a "drafter" per bundle: γ = 0 and the bundle's default drafter at its own γ
    cfgs = [Config(b, g) for b, d in decs.items() for g in (0, (d.manifest.drafter or {}).get("gamma", d.manifest.gamma))]
    rows = []
    for temp in (float(t) for t in args.temperatures.split(",")):
        tallies = run(decs, cfgs, prompts, args.tokens, args.rounds, temp, ignore_eos=False)
        for c, t in tallies.items():
            ar = tallies[Config(c.drafter, 0)]
            step = ar.target_seconds / ar.target_calls  # one 1-token target call
            rows.append({"bundle": c.drafter, "head": decs[c.drafter].manifest.head.quantization or "float32", "T": temp,
                         "drafter": "autoregressive" if c.gamma == 0 else f"{decs[c.drafter].drafter_spec} γ={c.gamma}",
                         "tok_s": round(t.tokens / t.seconds, 1), "vs_own_ar": round((t.tokens / t.seconds) / (ar.tokens / ar.seconds), 3),
                         "alpha": round(alpha_mle(t.accepted, t.rejected), 3) if c.gamma else None,
                         "c": round(t.draft_seconds / t.drafted / step, 3) if t.drafted else None})
            print(rows[-1], flush=True)
    out = {"provenance": {**provenance(), "command": " ".join(["python", "tools/bench_head_precision.py", *sys.argv[1:]])},
           "corpus": args.corpus, "prompts": len(prompts), "tokens": args.tokens, "rounds": args.rounds, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""Which ONNX Runtime thread policy decodes fastest: every ``ThreadPolicy`` on one bundle, interleaved.

The shared pool is process-wide in ONNX Runtime (once made, per-session pools are refused), so
each policy runs in its own child process; the rounds alternate the policies, so machine noise
hits all alike. Per policy and configuration (γ = 0 and the bundle's γ, T = 0 and 1): decode
tokens/s summed over held-out prompts (``specdec.bench``), and the median over rounds.

    python tools/bench_threads.py BUNDLE [--threads 2] [--rounds 3] [--out docs/bench/threads.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

POLICIES = {
    "per-session (default)": "ThreadPolicy.per_session(THREADS)",
    "per-session, no spin": "ThreadPolicy.per_session(THREADS, spin=False)",
    "shared": "ThreadPolicy.shared(THREADS)",
}
CHILD = """
import json, sys
from specdec.bench import held_out_prompts
from specdec.runtime import SpeculativeDecoder, ThreadPolicy
THREADS = {threads}
dec = SpeculativeDecoder.load({bundle!r}, threads={policy})
prompts = held_out_prompts(dec.codec.encode, {prompts}, 64)
out = {{}}
for gamma in (0, dec.manifest.gamma):
    for t in (0.0, 1.0):
        dec.generate(prompts[0], max_new_tokens=8, gamma=gamma, temperature=t, seed=0)  # warm-up
        tokens = seconds = 0
        for i, p in enumerate(prompts):
            s = dec.generate(p, max_new_tokens={tokens}, gamma=gamma, temperature=t, seed=i, ignore_eos=True).stats
            tokens += s.new_tokens
            seconds += s.total_seconds - s.prefill_seconds
        out[f"gamma={{gamma}} T={{t:g}}"] = tokens / seconds
print(json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {name: [] for name in POLICIES}
    for r in range(args.rounds):
        for name, policy in POLICIES.items():
            code = CHILD.format(threads=args.threads, bundle=str(args.bundle), policy=policy, prompts=args.prompts, tokens=args.tokens)
            res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
            if res.returncode:
                print(res.stderr[-2000:], file=sys.stderr)
                return 1
            runs[name].append(json.loads(res.stdout.splitlines()[-1]))
            print(f"round {r + 1}: {name}: {runs[name][-1]}", file=sys.stderr)
    cols = list(runs[next(iter(POLICIES))][0])
    lines = [f"{args.prompts} held-out prompts x {args.tokens} new tokens, {args.threads} threads, {args.rounds} interleaved rounds; "
             "decode tok/s, median over rounds (min-max)", "",
             "| policy | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for name, rs in runs.items():
        cells = [f"{statistics.median(x[c] for x in rs):.0f} ({min(x[c] for x in rs):.0f}-{max(x[c] for x in rs):.0f})" for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        args.out.write_text(f"`python tools/bench_threads.py {args.bundle} --threads {args.threads} --rounds {args.rounds}`\n\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""ONNX Runtime's thread policies on a real model, on an idle machine and on a loaded one.

The earlier thread study (docs/bench/threads.md) ran the demo pair, whose weights sit in this
CPU's cache; a real model's 1-token call streams its weights from memory, and a box shared with
other work takes thread wake-ups differently. Here: SmolLM2 bundles (float32, int8), greedy
decoding at γ = 0 of held-out chat prompts, each policy in its own process (the shared pool is
process-wide), rounds interleaved with the order rotated; "loaded" runs beside one busy process
per ``--busy`` (a Python spin loop), started before the run and stopped after it.

    python tools/bench_threads_real.py B32 B8 --rounds 3 --out docs/bench/threads-real/results.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

POLICIES = {
    "per-session x2 (default)": ("per_session", 2, True),
    "per-session x2, no spin": ("per_session", 2, False),
    "per-session x1": ("per_session", 1, True),
    "shared x2": ("shared", 2, True),
}


def worker(bundle: str, policy: str, prompts: int, tokens: int) -> None:
    """Decode in this process under ``policy``; print tokens/s (decoding after the prefill)."""
    from specdec.bench.corpus import chat_prompts
    from specdec.engines.threads import ThreadPolicy
    from specdec.runtime import SpeculativeDecoder

    kind, n, spin = POLICIES[policy]
    threads = ThreadPolicy.shared(n) if kind == "shared" else ThreadPolicy.per_session(n, spin=spin)
    dec = SpeculativeDecoder.load(bundle, drafter="lookup", threads=threads)
    ps = chat_prompts(Path(bundle), dec.manifest, dec.codec, "chat", prompts)
    dec.generate(ps[0], max_new_tokens=8, ignore_eos=True, gamma=0)  # warm-up
    new, seconds = 0, 0.0
    for p in ps:
        r = dec.generate(p, max_new_tokens=tokens, ignore_eos=True, gamma=0)
        new += len(r.tokens)
        seconds += r.stats.total_seconds - r.stats.prefill_seconds
    print(json.dumps({"tok_s": new / seconds}))


def run(bundle: str, policy: str, prompts: int, tokens: int, busy: int) -> float:
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        out = subprocess.run([sys.executable, __file__, "--worker", bundle, policy, "--prompts", str(prompts), "--tokens", str(tokens)],
                             capture_output=True, text=True, check=True, timeout=900)  # fmt: skip
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    return json.loads(out.stdout.strip().splitlines()[-1])["tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundles", nargs="*")
    ap.add_argument("--worker", nargs=2, metavar=("BUNDLE", "POLICY"), help=argparse.SUPPRESS)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy", type=int, default=1, help="busy processes beside the loaded runs")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.worker:
        return worker(*a.worker, a.prompts, a.tokens)
    from specdec.bench.report import write_results
    from specdec.manifest import load_manifest

    loads = {"idle": 0, "loaded": a.busy}
    tok_s: dict[tuple[str, str, str], list[float]] = {}
    names = list(POLICIES)
    for r in range(a.rounds):
        for load, busy in loads.items():
            for bundle in a.bundles:
                for policy in names[r % len(names) :] + names[: r % len(names)]:
                    tok_s.setdefault((bundle, load, policy), []).append(run(bundle, policy, a.prompts, a.tokens, busy))
                    print(bundle, load, policy, f"{tok_s[(bundle, load, policy)][-1]:.1f}", flush=True)
    rows = []
    for (bundle, load, policy), v in tok_s.items():
        width = load_manifest(bundle, "size").target.quantization or "fp32"
        base = np.median(tok_s[(bundle, load, names[0])])
        rows.append({"bundle": bundle, "width": width, "load": load, "policy": policy, "tok_s": round(float(np.median(v)), 1),
                     "min": round(min(v), 1), "max": round(max(v), 1), "vs_default": round(float(np.median(v) / base), 3)})  # fmt: skip
    what = (f"greedy decoding at γ = 0, {a.prompts} held-out chat prompts x {a.tokens} tokens, {a.rounds} rounds interleaved (median, min-max); "
            f"each policy in its own process; loaded: beside {a.busy} busy process(es) on this {__import__('os').cpu_count()}-core CPU")  # fmt: skip
    write_results(a.out.parent if a.out else None, None, {"what": what, "rows": rows}, name=a.out.stem if a.out else "results")
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()

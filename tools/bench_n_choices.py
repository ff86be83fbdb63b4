"""What n choices of one long prompt cost a server: the request's wall time, this tree against
another (``--old``), alternated request by request on one machine.

    python tools/bench_n_choices.py BUNDLE --old DIR [--n 8] [--prompt-tokens 400] [--tokens 16] [--rounds 5]

``--old DIR``: a folder whose ``specdec`` package is the other tree (as for tools/bench_serve.py).
Each round sends one non-streamed completion (T=1, seeded, EOS ignored) to each server in turn,
the order flipping every round; reported: the median seconds of each and of their ratio.
Since this tree feeds the prompt once and copies its KV to the other n - 1 rows, the gain grows
with the prompt's share of the work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from specdec.bench import held_out_prompts
from specdec.manifest import load_manifest
from specdec.runtime.text import TextCodec
from specdec.serve.process import ServerProcess


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--old", type=Path, required=True)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    bundle = a.bundle.resolve()
    m = load_manifest(bundle)
    prompt = held_out_prompts(TextCodec.from_bundle(bundle, m).encode, 1, a.prompt_tokens)[0]
    logs = Path(tempfile.mkdtemp(prefix="specdec-bench-n-"))
    common = ("--served-model-name", "bench", "--log-level", "warning")
    env = {**os.environ, "PYTHONPATH": str(a.old.resolve())}
    servers = {"new": ServerProcess(bundle, *common, log=logs / "new.log"), "old": ServerProcess(bundle, *common, log=logs / "old.log", env=env, cwd=a.old)}
    body = {"model": "bench", "prompt": prompt, "n": a.n, "max_tokens": a.tokens, "temperature": 1.0, "seed": 1, "ignore_eos": True}
    times: dict[str, list[float]] = {"new": [], "old": []}
    try:
        for s in servers.values():
            s.wait_ready()
        for rnd in range(a.rounds + 1):  # round 0 warms up
            for name in (("new", "old") if rnd % 2 else ("old", "new")):
                t0 = time.perf_counter()
                r = httpx.post(servers[name].url + "/v1/completions", json=body, timeout=600)
                r.raise_for_status()
                if rnd:
                    times[name].append(time.perf_counter() - t0)
    finally:
        for s in servers.values():
            s.close()
    ratio = [n / o for n, o in zip(times["new"], times["old"])]
    result = {"bundle": str(bundle), "n": a.n, "prompt_tokens": len(prompt), "tokens": a.tokens, "rounds": a.rounds,
              "new_s": statistics.median(times["new"]), "old_s": statistics.median(times["old"]), "new_over_old": statistics.median(ratio),
              "ratios": ratio}  # fmt: skip
    print(json.dumps(result, indent=1))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / f"n{a.n}-p{len(prompt)}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

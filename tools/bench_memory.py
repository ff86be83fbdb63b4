#!/usr/bin/env python3
"""Resident memory of a loaded decoder: what loading a bundle adds, against weights + KV cache.

Each bundle is measured in a fresh Python process (so nothing is shared between them): the
process imports specdec and onnxruntime, reads its resident set (``VmRSS``) and proportional
set (``Pss`` from ``/proc/self/smaps_rollup``: a page mapped twice, e.g. one weights file read
by two sessions, counts once), loads ``SpeculativeDecoder`` (or ``BatchEngine`` with
``--batch``), decodes one request so that every weight page has been touched, and reads them
again. The difference is set against the bundle's weights (each distinct tensor once: the
``*.weights`` files, or for an older bundle one graph per model) plus the KV buffers the
runtime allocates (layers x 2 x kvH x MAX x D x dtype bytes per model; per slot + 1 scratch
slot for the batched engine).

    python tools/bench_memory.py BUNDLE [BUNDLE ...] [--batch] [--out docs/bench/memory]

``--runtime DIR`` measures another specdec release installed with ``pip install --no-deps
--target DIR <checkout>`` (the child runs ``python -S`` with DIR and site-packages on its path,
so the editable install is not seen): how the "before" rows of docs/performance.md's memory table were taken.
"""

from __future__ import annotations

import argparse
import json
import os
import site
import subprocess
import sys
from pathlib import Path

from specdec.bench.floor import weights_bytes
from specdec.bench.report import write_results

CHILD = r"""
import json, sys
from pathlib import Path
import numpy as np

def mem():
    rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS"))
    pss = next(int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("Pss:"))
    return rss / 1024, pss / 1024

import onnxruntime, specdec.runtime  # imports are not the decoder's memory
from specdec.runtime.batch import BatchEngine
from specdec.runtime.decoder import SpeculativeDecoder

bundle, batch = Path(sys.argv[1]), sys.argv[2] == "1"
before = mem()
prompt = list(range(3, 67))
if batch:
    engine = BatchEngine(bundle, threads=2)
    handles = [engine.submit(prompt, max_new_tokens=64) for _ in range(engine.max_batch)]
    for h in handles:
        h.result()
else:
    dec = SpeculativeDecoder.load(bundle, threads=2)
    dec.generate(prompt, max_new_tokens=64)
after = mem()
print(json.dumps({"rss_mib": after[0] - before[0], "pss_mib": after[1] - before[1]}))
if batch:
    engine.close()
"""


def kv_bytes(m, slots: int) -> int:
    item = 2 if m.dtype == "float16" else 4
    return sum(s.num_layers * 2 * s.num_kv_heads * m.max_seq_len * s.head_dim * item * slots for s in (m.target, m.draft))


def measure(bundle: Path, batch: bool, runtime: Path | None) -> dict:
    from specdec.manifest import load_manifest

    m = load_manifest(bundle, verify_hashes=False)
    cmd, env = [sys.executable, "-c", CHILD, str(bundle.resolve()), "1" if batch else "0"], None
    if runtime is not None:
        cmd.insert(1, "-S")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(runtime), *site.getsitepackages()]))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/")  # "/": no checkout on sys.path[0]
    if out.returncode:
        raise SystemExit(f"measuring {bundle} failed:\n{out.stderr[-2000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    w, kv = sum(weights_bytes(bundle, m, model) for model in ("target", "draft")), kv_bytes(m, m.max_batch + 1 if batch else 1)
    base = (w + kv) / 2**20
    size = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file()) / 2**20
    return {"bundle": str(bundle), "runtime": str(runtime or "this checkout"), "engine": "BatchEngine" if batch else "SpeculativeDecoder", "max_batch": m.max_batch,
            "bundle_mib": round(size, 1), "weights_mib": round(w / 2**20, 1), "kv_mib": round(kv / 2**20, 1),
            "rss_added_mib": round(got["rss_mib"], 1), "pss_added_mib": round(got["pss_mib"], 1),
            "rss_ratio": round(got["rss_mib"] / base, 2), "pss_ratio": round(got["pss_mib"] / base, 2)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bundles", nargs="+", type=Path)
    ap.add_argument("--batch", action="store_true", help="also load each bundle's BatchEngine (max-batch rows)")
    ap.add_argument("--out", type=Path, default=None, help="write results.md and results.json here")
    ap.add_argument("--runtime", type=Path, default=None, help="a specdec installed with pip install --target DIR (see above)")
    a = ap.parse_args()
    rows = [measure(b, False, a.runtime) for b in a.bundles] + ([measure(b, True, a.runtime) for b in a.bundles] if a.batch else [])
    head = "| bundle | runtime | engine | bundle on disk MiB | weights MiB | KV MiB | added RSS MiB (× weights+KV) | added PSS MiB (×) |\n|---|---|---|---|---|---|---|---|"
    lines = [head] + [f"| {r['bundle']} | {r['runtime']} | {r['engine']} | {r['bundle_mib']} | {r['weights_mib']} | {r['kv_mib']} | "
                      f"{r['rss_added_mib']} ({r['rss_ratio']}×) | {r['pss_added_mib']} ({r['pss_ratio']}×) |" for r in rows]  # fmt: skip
    md = "\n".join(lines)
    print(md)
    write_results(a.out, md, rows)


if __name__ == "__main__":
    main()

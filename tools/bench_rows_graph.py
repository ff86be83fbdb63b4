#!/usr/bin/env python3
"""One target call through a rows graph (export/rows.py) against the per-size graph it replaced.

Two bundles of one checkpoint: ``ROWS`` exported by this specdec (one ``target_rows.onnx``,
every row count in one session) and ``PER_SIZE`` exported before the merge (one
``target_batchN.onnx`` per row count, each its own session). For each row count B of
``PER_SIZE`` and 1 or K tokens per row, both runners (``engines/batch.py``) run over the same
slot cache (``--past`` committed rows per slot); calls alternate between the two, their order
flipped every call, and the medians are compared.

    python tools/bench_rows_graph.py ROWS PER_SIZE [--calls 30] [--past 128] [--threads 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from specdec.bench.report import write_results
from specdec.engines.batch import BatchRunner, SlotCache
from specdec.engines.ort import open_session
from specdec.manifest import load_manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", type=Path)
    ap.add_argument("per_size", type=Path)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    new, old = load_manifest(a.rows, verify="size"), load_manifest(a.per_size, verify="size")
    merged = new.rows_graph("target")
    if merged is None or old.rows_graph("target") is not None or not old.batch_sizes():
        raise SystemExit(f"expected {a.rows} with a rows graph and {a.per_size} with one batched graph per row count")
    t = new.target
    cache = SlotCache(t.num_layers, t.num_kv_heads, new.max_seq_len, t.head_dim, new.dtype, new.max_batch)
    for s in range(new.max_batch):
        cache.slot(s).append(a.past)
    rows = BatchRunner(open_session(a.rows, *merged, threads=a.threads), *merged, cache, new.k)
    out = []
    for b in old.batch_sizes():
        name, g = old.graph("target", "dynamic", batch=b)
        per = BatchRunner(open_session(a.per_size, name, g, threads=a.threads), name, g, cache, old.k)
        for width in (1, new.k):
            feeds = [np.full(width, 5)] * b
            times = {"rows": [], "per": []}
            rows.run(range(b), feeds)
            per.run(range(b), feeds)
            for i in range(a.calls):
                for key, runner in (("rows", rows), ("per", per)) if i % 2 else (("per", per), ("rows", rows)):
                    t0 = time.perf_counter()
                    runner.run(range(b), feeds)
                    times[key].append(time.perf_counter() - t0)
            ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            out.append({"rows": b, "tokens_per_row": width, "rows_graph_ms": round(ms["rows"], 2), "per_size_ms": round(ms["per"], 2),
                        "ratio": round(ms["rows"] / ms["per"], 3)})  # fmt: skip
            print(f"| {b} | {width} | {ms['rows']:.2f} | {ms['per']:.2f} | {ms['rows'] / ms['per']:.3f} |", flush=True)
        del per
    md = ["| rows | tokens per row | rows graph ms | per-size graph ms | rows / per-size |", "|---:|---:|---:|---:|---:|"]
    md += [f"| {r['rows']} | {r['tokens_per_row']} | {r['rows_graph_ms']:.2f} | {r['per_size_ms']:.2f} | {r['ratio']:.3f} |" for r in out]
    if a.out:
        write_results(a.out, "\n".join(md) + "\n", {"rows": out, "settings": {"rows_bundle": str(a.rows), "per_size_bundle": str(a.per_size),
                                                                              "calls": a.calls, "past": a.past, "threads": a.threads}})  # fmt: skip


if __name__ == "__main__":
    main()

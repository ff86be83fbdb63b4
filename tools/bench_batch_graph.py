"""Cost of one target call per (rows, width): the batched graphs against the batch-1 dynamic graph.

For rows R and width S (new tokens per row), times a call of R rows through the bundle's rows
graph (export/rows.py: its R-row body; an older bundle's R-row graph), R x S tokens with one
batch-1 GroupQueryAttention per row over its own slot, and, for comparison, one batch-1
dynamic-graph call of R x S tokens in a single sequence (the same token count, the dense cost
without per-row attention). Every row has ``--past`` committed rows. Median of ``--calls``
calls after warm-up, the two sides interleaved.

    python tools/bench_batch_graph.py BUNDLE [--past 128] [--calls 30] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from specdec.engines.batch import BatchRunner, SlotCache
from specdec.engines.kv import KVCache
from specdec.engines.ort import open_session, runner_for
from specdec.manifest import load_manifest


def timed(fn, calls: int) -> float:
    fn()
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    args.bundle = Path(args.bundle)
    m = load_manifest(args.bundle)
    t = m.target
    cache = KVCache(t.num_layers, t.num_kv_heads, m.max_seq_len, t.head_dim, m.dtype)
    single = runner_for(args.bundle, *m.graph("target", "dynamic"), cache, threads=args.threads)
    cache.append(args.past)
    print(f"bundle {args.bundle}: target {t.parameters / 1e6:.1f}M params; {args.past} past rows per row; median ms per call\n")
    print("| rows | tokens per row | batched graph (ms) | one sequence of rows x tokens (ms) | batched / one sequence | ms per token (batched) |")
    print("|---:|---:|---:|---:|---:|---:|")
    merged = m.rows_graph("target")
    sizes = merged[1].rows if merged else (1, *m.batch_sizes())
    slots = SlotCache(t.num_layers, t.num_kv_heads, m.max_seq_len, t.head_dim, m.dtype, max(sizes))
    for s in range(max(sizes)):
        slots.slot(s).append(args.past)
    runners = {}
    for rows in sizes:
        if merged or rows > 1:
            name, spec = merged or m.graph("target", "dynamic", batch=rows)
            if name not in runners:
                runners[name] = BatchRunner(open_session(args.bundle, name, spec, threads=args.threads), name, spec, slots, m.k)
            runner = runners[name]
        for width in (1, 2, m.k):
            seq = np.arange(3, 3 + rows * width) % m.vocab_size
            one = timed(lambda: single.run(seq), args.calls)
            if rows == 1 and not merged:
                print(f"| 1 | {width} | – | {one:.2f} | – | {one / width:.2f} |")
                continue
            feeds = [np.full(width, 5)] * rows
            b = timed(lambda: runner.run(range(rows), feeds), args.calls)
            print(f"| {rows} | {width} | {b:.2f} | {one:.2f} | {b / one:.2f} | {b / (rows * width):.2f} |")


if __name__ == "__main__":
    main()

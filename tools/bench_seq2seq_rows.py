#!/usr/bin/env python3
"""An encoder-decoder bundle's rows graphs (issue 50): what a call of B rows costs, and what an engine of B rows holds.

Two questions, each answered in its own fresh process per bundle:

- **Cost per row.** The target's rows graph (every row over its own KV slot and its own source's
  cross K/V) at B = 1, 2, 4, .. rows of 1 and of γ + 1 tokens a call, against the batch-1
  decoder graph a lone request runs, interleaved (order reversed every other round), median
  of the rounds: ms a call and ms a row. Beside it, the target's encoder over 48-token sources:
  the batch-1 encoder, and the batched one at 1 and at max-batch sources a call.
- **Memory.** A ``BatchEngine`` of the bundle's max-batch rows, every row busy with its own
  source: the resident (``VmRSS``) and proportional (``Pss``) memory that loading and decoding
  add, against the weights (each distinct tensor once) + the KV buffers + the cross K/V buffers
  it allocates (per model, max-batch + 1 slots each).

    python tools/bench_seq2seq_rows.py BUNDLE [BUNDLE ...] [--rounds 5] [--calls 50] [--out docs/bench/seq2seq/rows]

Aggregate throughput under concurrent requests is ``specdec bench-serve`` / ``bench-batch``'s
(docs/bench/seq2seq/README.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

COST = r"""
import json, sys, time
from pathlib import Path
import numpy as np
from specdec.engines.executor import Executor, graph_names, open_sessions
from specdec.engines.threads import ThreadPolicy
from specdec.manifest import load_manifest

bundle, rounds, calls = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
m = load_manifest(bundle, "size")
vocab, threads = m.vocab_size, ThreadPolicy.of(None)
source = (np.arange(48) * 7 + 3) % vocab  # [48]
prefix = (np.arange(32) * 5 + 4) % vocab  # [32]: committed decoder rows before the timed calls
engines = {}
for slots in (1, m.max_batch):
    ex = Executor(bundle, m, "target", open_sessions(bundle, m, graph_names(m, ("target",), slots, fused=False), "cpu", threads), "cpu", slots)
    for s in range(slots):
        ex.encode(s, source)
        ex.forward([s], [prefix])
        ex.commit(s, len(prefix))
    engines[slots] = ex
cases = [(1, 1, n) for n in (1, m.k)] + [(m.max_batch, b, n) for b in (m.rows_graph("target")[1].rows or ()) for n in (1, m.k)]
times = {c: [] for c in cases}
for r in range(rounds):
    for case in cases if r % 2 == 0 else cases[::-1]:
        slots, rows, n = case
        ex, feeds = engines[slots], [np.full(n, 5, dtype=np.int64)] * rows
        for _ in range(5):
            ex.forward(list(range(rows)), feeds)
        t = time.perf_counter()
        for _ in range(calls):
            ex.forward(list(range(rows)), feeds)
        times[case].append((time.perf_counter() - t) / calls * 1e3)
out = [{"graph": "batch-1" if s == 1 else "rows", "rows": b, "tokens": n, "ms_call": float(np.median(times[(s, b, n)]))} for s, b, n in cases]
# the encoder: a source's prefill, compute-bound where the decoder's calls are not
encodes = {("batch-1", 1): lambda: engines[1].encode(0, source)}
encodes.update({("batched", b): (lambda b=b: engines[m.max_batch].encode_many(list(range(b)), [source] * b)) for b in (1, m.max_batch)})
enc_times = {c: [] for c in encodes}
for r in range(rounds):
    for case in list(encodes) if r % 2 == 0 else list(encodes)[::-1]:
        encodes[case]()
        t = time.perf_counter()
        for _ in range(max(3, calls // 5)):
            encodes[case]()
        enc_times[case].append((time.perf_counter() - t) / max(3, calls // 5) * 1e3)
enc = [{"graph": g, "sources": b, "source_tokens": len(source), "ms_call": float(np.median(enc_times[(g, b)]))} for g, b in encodes]
print(json.dumps({"decoder": out, "encoder": enc}))
"""

MEMORY = r"""
import json, sys
from collections import Counter
from pathlib import Path

def pss(bundle):
    # PSS KiB by kind of mapping: the process's own memory (heap, anonymous), the bundle's files, libraries' files
    out, kind = Counter(), None
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0]:  # a mapping's first line: address range, perms, offset, dev, inode[, path]
            path = head[5] if len(head) > 5 else ""
            kind = "bundle" if path.startswith(str(bundle)) else "library" if path.startswith("/") else "own"
        elif head[0] == "Pss:":
            out[kind] += int(head[1])
    return out

def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024

import onnxruntime, specdec.runtime  # imports are not the engine's memory
from specdec.runtime.batch import BatchEngine

bundle = Path(sys.argv[1]).resolve()
before, rss0 = pss(bundle), rss()
engine = BatchEngine(bundle, threads=2)
vocab = engine.manifest.vocab_size
handles = [engine.submit([(7 * i + 11 * j + 3) % vocab for j in range(40 + 4 * i)], max_new_tokens=48, ignore_eos=True) for i in range(engine.max_batch)]
for h in handles:
    h.result()
after = pss(bundle)
added = {k: (after[k] - before[k]) / 1024 for k in ("own", "bundle", "library")}
print(json.dumps({"rss_mib": rss() - rss0, "pss_mib": sum(added.values()), "own_pss_mib": added["own"], "bundle_pss_mib": added["bundle"],
                  "library_pss_mib": added["library"], "rows_together": max(engine.occupancy)}))
engine.close()
"""


def weights_bytes(bundle: Path, m) -> int:
    """Distinct weight bytes: each model's shared ``*.weights`` file(s)."""
    files = {f for model in ("target", "draft") for f in m.graph(model, "dynamic")[1].data}
    return sum((bundle / f).stat().st_size for f in files)


def buffer_bytes(m, slots: int) -> tuple[int, int]:
    """(self-attention KV, cross K/V) bytes an engine of ``slots`` slots allocates, both models."""
    item = 2 if m.dtype == "float16" else 4
    kv = sum(s.num_layers * 2 * s.num_kv_heads * m.max_seq_len * s.head_dim * item * slots for s in (m.target, m.draft))
    cross = sum(s.num_layers * 2 * s.num_heads * m.max_source_len * s.head_dim * item * slots for s in (m.target, m.draft))
    return kv, cross


def child(code: str, *args: str) -> dict | list:
    res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=False)
    if res.returncode:
        raise SystemExit(f"measuring {args[0]} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    from specdec.bench.report import write_results
    from specdec.manifest import load_manifest

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundles", nargs="+", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50, help="timed calls per case and round")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    lines, data = [], {}
    for bundle in args.bundles:
        m = load_manifest(bundle, "size")
        if not m.seq2seq or m.rows_graph("target") is None:
            raise SystemExit(f"{bundle}: expected an encoder-decoder bundle exported with --max-batch 2 or more")
        calls = child(COST, str(bundle), str(args.rounds), str(args.calls))
        cost, encoder = calls["decoder"], calls["encoder"]
        memory = child(MEMORY, str(bundle))
        weights = weights_bytes(bundle, m)
        kv, cross = buffer_bytes(m, m.max_batch + 1)
        base = (weights + kv + cross) / 2**20
        memory.update(weights_mib=weights / 2**20, kv_mib=kv / 2**20, cross_mib=cross / 2**20, rss_ratio=memory["rss_mib"] / base,
                      pss_ratio=memory["pss_mib"] / base, engine_ratio=(memory["own_pss_mib"] + memory["bundle_pss_mib"]) / base)  # fmt: skip
        data[bundle.name] = {"target": m.target.source, "parameters": m.target.parameters, "max_batch": m.max_batch, "cost": cost, "encoder": encoder,
                          "memory": memory}  # fmt: skip
        single = {c["tokens"]: c["ms_call"] for c in cost if c["graph"] == "batch-1"}
        lines += [f"**{bundle.name}**: target {m.target.parameters / 1e6:.1f}M parameters ({m.target.family}, {m.target.num_layers} decoder layers), "
                  f"{m.dtype}, max-batch {m.max_batch}; the target's calls over 32 committed rows and a 48-token source per row", "",
                  "| graph | rows | tokens a row | ms a call | ms a row | a row's cost / the batch-1 graph's |", "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for c in cost:
            per_row = c["ms_call"] / c["rows"]
            lines.append(f"| {c['graph']} | {c['rows']} | {c['tokens']} | {c['ms_call']:.3f} | {per_row:.3f} | {per_row / single[c['tokens']]:.2f} |")
        lines += ["", "The target's encoder over 48-token sources (a source's prefill): "
                  + "; ".join(f"{e['graph']} graph, {e['sources']} source{'s' if e['sources'] > 1 else ''} a call: {e['ms_call']:.2f} ms"
                              for e in encoder)]  # fmt: skip
        lines += ["", f"BatchEngine of {m.max_batch} rows ({memory['rows_together']} decoded together), every row its own source: added RSS "
                  f"{memory['rss_mib']:.1f} MiB ({memory['rss_ratio']:.2f}× weights + KV + cross K/V), PSS {memory['pss_mib']:.1f} MiB "
                  f"({memory['pss_ratio']:.2f}×), of which the engine's own and the bundle's mapped files "
                  f"{memory['own_pss_mib'] + memory['bundle_pss_mib']:.1f} MiB ({memory['engine_ratio']:.2f}×) and libraries' code and "
                  f"data first touched {memory['library_pss_mib']:.1f} MiB; weights {memory['weights_mib']:.1f} MiB, KV {memory['kv_mib']:.1f} MiB, cross K/V "
                  f"{memory['cross_mib']:.1f} MiB ({m.max_batch} + 1 slots a model)", ""]  # fmt: skip
    md = "\n".join(lines)
    print(md)
    write_results(args.out, md, data)


if __name__ == "__main__":
    main()

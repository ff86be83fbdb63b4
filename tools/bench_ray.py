"""What Ray Serve costs and gives on this machine: the plain server vs Ray Serve with 1 and 2 replicas.

Configurations, each measured with the same bounded load (``served_load`` of bench_serve: a
fixed number of streamed requests from N client tasks, on 127.0.0.1):

- ``specdec serve``: one process, one engine (``--threads`` ORT threads per session)
- Ray Serve, 1 replica: the same engine behind Ray's HTTP proxy
- Ray Serve, 2 replicas: two engines, each with ``--threads`` / 2 ORT threads (the box's cores shared)

    python tools/bench_ray.py BUNDLE [--concurrency 1,8] [--requests 32] [--out docs/bench/ray]

Ray runs as a local instance (``--num-cpus`` CPUs) for the Ray rows and is shut down after them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

from bench_serve import served_load

from specdec.bench import held_out_prompts
from specdec.bench.load import markdown
from specdec.bench.report import write_results
from specdec.manifest import load_manifest
from specdec.runtime.text import TextCodec
from specdec.serve.process import ServerProcess
from specdec.serve.server import ServeConfig, free_port


def measure(url: str, mode: str, levels: list[int], work: list[list[int]], a) -> list[dict]:
    rows = []
    for c in levels:
        asyncio.run(served_load(url, mode, c, work[:c], a.tokens, 0.0, a.timeout))  # warm-up
        rows.append(asyncio.run(served_load(url, mode, c, work, a.tokens, 0.0, a.timeout)).row())
        r = rows[-1]
        print(f"{mode:>28} c={c:<3} {r['tok_s']:7.0f} tok/s {r['req_s']:6.2f} req/s TTFT p50 {r['ttft_p50_ms']:.1f} ms errors {r['errors']}", file=sys.stderr)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="ORT threads per session of the single engine")
    ap.add_argument("--num-cpus", type=float, default=os.cpu_count() or 2, help="CPUs of the local Ray instance")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()

    m = load_manifest(a.bundle)
    prompts = held_out_prompts(TextCodec.from_bundle(a.bundle, m).encode, 8, 64)
    work = [prompts[i % len(prompts)] for i in range(a.requests)]
    levels = [int(x) for x in a.concurrency.split(",")]
    rows = []

    logs = Path(tempfile.mkdtemp(prefix="specdec-bench-ray-"))
    s = ServerProcess(a.bundle, "--threads", str(a.threads), "--served-model-name", "bench", "--log-level", "warning", log=logs / "serve.log")
    try:
        s.wait_ready()
        rows += measure(s.url, "specdec serve", levels, work, a)
    finally:
        s.close()

    import ray
    from ray import serve

    from specdec.serve.ray_app import application

    port = free_port()
    ray.init(num_cpus=a.num_cpus, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")  # loopback only
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        for replicas in (1, 2):
            threads = max(1, a.threads // replicas)
            cfg = ServeConfig(a.bundle, host="127.0.0.1", port=port, threads=threads, served_model_name="bench")
            t0 = time.perf_counter()
            serve.run(application(cfg, replicas=replicas, num_cpus=a.num_cpus / replicas), name="specdec", route_prefix="/")
            print(f"{replicas} replica(s) ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            rows += measure(url, f"Ray Serve, {replicas} replica{'s' if replicas > 1 else ''} × {threads} thr", levels, work, a)
            serve.delete("specdec")
    finally:
        serve.shutdown()
        ray.shutdown()

    header = (f"bundle {a.bundle}: max-batch {m.max_batch}, γ {m.gamma} (the bundle's, fixed); {a.requests} streamed requests per run of 64 "
              f"prompt + {a.tokens} new tokens (held-out prompts), EOS ignored, T=0; all on this machine, 127.0.0.1")  # fmt: skip
    md = markdown(rows, header)
    print(md)
    write_results(a.out, md, rows)


if __name__ == "__main__":
    main()

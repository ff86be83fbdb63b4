"""Load benchmark of ``specdec serve``: a bounded asyncio load generator against servers on 127.0.0.1.

One server per γ mode (default: the bundle's γ, auto, and 0 = plain decoding), all started at
once on free loopback ports; at every concurrency the modes run one after another
(interleaved, so machine drift hits them alike). Each run sends a fixed number of streamed
requests (held-out prompts, EOS ignored) from ``concurrency`` client tasks and records
requests/s, output tokens/s, TTFT and inter-token latency (client-side, from the SSE chunks)
and errors. At concurrency 1 the same requests also run on an in-process ``BatchEngine``: the
ratio is what the HTTP layer costs a single request (several rounds, alternating, since this box
drifts).

    python tools/bench_serve.py BUNDLE [--concurrency 1,4,8,16] [--requests 32] [--out docs/bench/serve]

``--old DIR``: also one server per mode from another tree (DIR holds its ``specdec`` package,
e.g. a ``git worktree`` of an earlier commit with its subpackages linked in, as for
tools/bench_ab.py), interleaved with this tree's at every concurrency: old/new on one machine.

Every run is bounded (request count and --timeout); the servers are stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from specdec.bench import held_out_prompts
from specdec.bench.load import Load, markdown, plot, run_load
from specdec.manifest import load_manifest
from specdec.runtime.text import TextCodec
from specdec.serve.process import ServerProcess


async def one_request(client: httpx.AsyncClient, prompt: list[int], tokens: int, temperature: float, seed: int, load: Load, stream: bool) -> None:
    body = {"model": "bench", "prompt": prompt, "max_tokens": tokens, "temperature": temperature, "seed": seed,
            "ignore_eos": True, "stream": stream, "return_token_ids": True}  # fmt: skip
    t0, arrivals = time.perf_counter(), []
    if not stream:  # one JSON body: only throughput is meaningful
        r = await client.post("/v1/completions", json=body)
        if r.status_code != 200:
            load.errors += 1
            return
        load.add(t0, [(time.perf_counter(), r.json()["usage"]["completion_tokens"])])
        return
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                load.errors += 1
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    load.errors += 1
                    return
                arrivals.append((time.perf_counter(), len(chunk["choices"][0].get("token_ids", []))))
    except httpx.HTTPError:
        load.errors += 1
        return
    load.add(t0, arrivals)


async def served_load(url: str, mode: str, concurrency: int, prompts: list[list[int]], tokens: int, temperature: float, timeout: float,
                      stream: bool = True) -> Load:  # fmt: skip
    """``concurrency`` client tasks take the prompts in turn; bounded by their count and ``timeout``."""
    load, todo = Load(mode, concurrency, temperature), list(enumerate(prompts))

    async def worker(client):
        while todo:
            i, prompt = todo.pop(0)
            await one_request(client, prompt, tokens, temperature, i, load, stream)

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.gather(*(worker(client) for _ in range(concurrency))), timeout)
        except asyncio.TimeoutError:
            print(f"  {mode} c={concurrency}: stopped at the {timeout:.0f} s bound", file=sys.stderr)
        load.seconds = time.perf_counter() - t0
    return load


def http_overhead(a, servers: dict, names: dict, work: list[list[int]]) -> list[dict]:
    """What the HTTP layer costs one request at a time: per mode, ``--overhead-rounds`` rounds of
    the same requests on an in-process ``BatchEngine``, then served streamed (SSE), then served
    as one JSON body, back to back; the ratios' median and range over the rounds."""
    from specdec.runtime.batch import BatchEngine

    out = []
    with BatchEngine(a.bundle, max_queue=len(work)) as engine:
        for g, s in servers.items():
            gamma = g if g == "auto" else int(g)
            stream = lambda i: lambda p: engine.submit(p, max_new_tokens=a.tokens, temperature=a.temperature, seed=i, gamma=gamma, ignore_eos=True)  # noqa: E731
            run_load(stream, "warm-up", 1, a.temperature, work[:1], a.timeout)
            rounds = []
            for _ in range(a.overhead_rounds):
                inproc = run_load(stream, "in-process", 1, a.temperature, work, a.timeout).row()["tok_s"]
                streamed = asyncio.run(served_load(s.url, "streamed", 1, work, a.tokens, a.temperature, a.timeout)).row()["tok_s"]
                whole = asyncio.run(served_load(s.url, "whole", 1, work, a.tokens, a.temperature, a.timeout, stream=False)).row()["tok_s"]
                rounds.append((inproc, streamed, whole))
            out.append({"mode": names[g], "rounds": rounds, "streamed_ratio": [x[1] / x[0] for x in rounds], "whole_ratio": [x[2] / x[0] for x in rounds]})
            print(f"  {names[g]}: in-process / streamed / whole tok/s per round: {[tuple(round(v) for v in x) for x in rounds]}", file=sys.stderr)
    return out


def span(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}–{max(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path, help="a bundle exported with --max-batch (the demo pair: see docs/serving.md)")
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--requests", type=int, default=32, help="requests per (mode, concurrency) run")
    ap.add_argument("--modes", default=None, help="gamma per server, comma-separated [default: the bundle's gamma,auto,0]")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=300.0, help="bound on each run, seconds")
    ap.add_argument("--overhead-rounds", type=int, default=3, help="rounds of the single-request HTTP overhead comparison")
    ap.add_argument("--overhead-requests", type=int, default=16, help="requests per round of that comparison")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--old", type=Path, default=None, help="a folder whose specdec package is another tree: its servers run beside these")
    ap.add_argument("--no-overhead", action="store_true", help="skip the HTTP-layer comparison")
    ap.add_argument("--distinct", action="store_true", help="every request its own prompt, warm-ups included (single-turn traffic: nothing to reuse)")
    a = ap.parse_args()

    m = load_manifest(a.bundle)
    codec = TextCodec.from_bundle(a.bundle, m)
    levels = [int(x) for x in a.concurrency.split(",")]
    prompts = held_out_prompts(codec.encode, a.requests + max(levels) if a.distinct else 8, a.prompt_tokens)
    work = prompts[: a.requests] if a.distinct else [prompts[i % len(prompts)] for i in range(a.requests)]
    warm = prompts[a.requests :] if a.distinct else work  # --distinct: no prompt sent twice (nothing for prefix reuse to keep)
    modes = (a.modes or f"{m.gamma},auto,0").split(",")
    names = {g: ("plain (γ=0)" if g == "0" else "adaptive γ" if g == "auto" else f"γ={g}") for g in modes}
    logs = Path(tempfile.mkdtemp(prefix="specdec-bench-serve-"))  # the servers' logs
    print(f"server logs in {logs}", file=sys.stderr)
    args = lambda g: (a.bundle, "--gamma", g, "--max-queue", str(max(levels) * 2), "--served-model-name", "bench", "--log-level", "warning")  # noqa: E731
    servers = {g: ServerProcess(*args(g), log=logs / f"server-gamma-{g}.log") for g in modes}
    old = {}
    if a.old:
        env = {**os.environ, "PYTHONPATH": str(a.old.resolve())}
        old = {g: ServerProcess(*args(g), log=logs / f"old-gamma-{g}.log", env=env, cwd=a.old) for g in modes}
        names.update({f"old {g}": f"{names[g]} (old)" for g in modes})
    rows = []
    try:
        for s in (*servers.values(), *old.values()):
            s.wait_ready()
        for c in levels:
            for g, s in [x for g in modes for x in ((g, servers[g]), *(((f"old {g}", old[g]),) if old else ()))]:
                mode = names[g]
                asyncio.run(served_load(s.url, mode, c, warm[:c], a.tokens, a.temperature, a.timeout))  # warm-up
                rows.append(asyncio.run(served_load(s.url, f"served {mode}", c, work, a.tokens, a.temperature, a.timeout)).row())
                r = rows[-1]
                print(f"{r['mode']:>22} c={c:<3} {r['tok_s']:7.0f} tok/s {r['req_s']:6.2f} req/s  TTFT p50 {r['ttft_p50_ms']:.1f} ms  "
                      f"ITL p99 {r['itl_p99_ms']:.2f} ms  errors {r['errors']}", file=sys.stderr)  # fmt: skip
        overhead = [] if a.no_overhead else http_overhead(a, servers, names, work[: a.overhead_requests])
    finally:
        for s in (*servers.values(), *old.values()):
            s.close()

    header = (f"bundle {a.bundle}: max-batch {m.max_batch}, γ {m.gamma}; {a.requests} streamed requests per run of {a.prompt_tokens} prompt + "
              f"{a.tokens} new tokens (held-out stdlib prompts), EOS ignored, T={a.temperature:g}; one server per mode on 127.0.0.1, "
              "modes interleaved at each concurrency; latencies measured by the client from the SSE chunks")  # fmt: skip
    md = markdown(rows, header)
    if overhead:
        md += ("\n\nHTTP layer, one request at a time: per round, the same requests on the in-process BatchEngine, then served streamed "
           "(SSE), then served as one JSON body, back to back; served / in-process tok/s, median (range) over the rounds:\n\n"
           "| mode | in-process tok/s (median) | served streamed / in-process | served whole / in-process |\n|---|---:|---:|---:|\n")
        md += "".join(f"| {o['mode']} | {statistics.median(x[0] for x in o['rounds']):.0f} | {span(o['streamed_ratio'])} | {span(o['whole_ratio'])} |\n" for o in overhead)
    print(md)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "results.md").write_text(md)
        (a.out / "results.json").write_text(json.dumps({"rows": rows, "overhead": overhead}, indent=1))
        try:
            plot(rows, a.out / "load.png")
        except ImportError:
            print("plots need matplotlib: pip install 'specdec[bench]'", file=sys.stderr)


if __name__ == "__main__":
    main()

"""Load benchmark of the batched engine: N concurrent synthetic clients, bounded in count and time.

Each client thread sends its share of a fixed number of requests one after another and reads
each as a stream, recording the time to the first token (TTFT) and the gap before every later
token (inter-token latency, ITL: a piece of m tokens after a gap g counts m gaps of g/m).
Modes, run side by side (interleaved) at every concurrency:

- ``batched adaptive``: ``BatchEngine``, γ chosen per iteration for the number of rows
- ``batched γ=G``: the same engine at the bundle's fixed γ
- ``batched plain``: the same engine with γ = 0 (batched autoregressive decoding)
- ``fork per thread``: today's path, one ``SpeculativeDecoder.fork()`` per client at the bundle's γ
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path



@dataclass
class Load:
    """What one (mode, concurrency, temperature) run measured."""

    mode: str
    concurrency: int
    temperature: float
    seconds: float = 0.0
    tokens: int = 0
    requests: int = 0
    errors: int = 0  # requests that failed (an HTTP error, a refused or broken stream)
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    per_request: list[float] = field(default_factory=list)  # tokens/s of each request after its first token

    def add(self, t0: float, arrivals: list[tuple[float, int]]) -> None:
        """One finished request sent at ``t0`` whose tokens arrived as (time, count) pieces."""
        arrivals = [(t, n) for t, n in arrivals if n]
        count = sum(n for _, n in arrivals)
        self.requests += 1
        self.tokens += count
        if not arrivals:
            return
        first, last = arrivals[0][0], arrivals[0][0]
        self.ttft.append(first - t0)
        for t, n in arrivals[1:]:
            self.itl += [(t - last) / n] * n
            last = t
        if last > first:
            self.per_request.append((count - 1) / (last - first))

    def row(self) -> dict:
        def q(xs: list[float], p: float) -> float:
            return statistics.quantiles(xs, n=100, method="inclusive")[p - 1] if len(xs) > 1 else (xs[0] if xs else 0.0)

        return {
            "mode": self.mode, "concurrency": self.concurrency, "temperature": self.temperature,
            "tok_s": self.tokens / self.seconds if self.seconds else 0.0, "tokens": self.tokens, "seconds": self.seconds,
            "requests": self.requests, "errors": self.errors,
            "req_s": self.requests / self.seconds if self.seconds else 0.0,
            "per_request_tok_s": statistics.median(self.per_request) if self.per_request else 0.0,
            "ttft_p50_ms": 1e3 * q(self.ttft, 50), "ttft_p99_ms": 1e3 * q(self.ttft, 99),
            "itl_p50_ms": 1e3 * q(self.itl, 50), "itl_p99_ms": 1e3 * q(self.itl, 99),
        }  # fmt: skip


def _client(stream_of, prompts: list[list[int]], load: Load, lock: threading.Lock, deadline: float) -> None:
    for prompt in prompts:
        if time.monotonic() > deadline:
            return
        t0 = time.perf_counter()
        arrivals = [(time.perf_counter(), len(piece.tokens)) for piece in stream_of(prompt)]
        with lock:
            load.add(t0, arrivals)


def run_load(stream_for, mode: str, concurrency: int, temperature: float, prompts: list[list[int]], timeout: float) -> Load:
    """``concurrency`` client threads share ``prompts`` (each its slice, in order); ``stream_for(i)``
    gives client i's ``prompt -> iterable of Piece``. Stops by itself after ``timeout`` seconds."""
    load, lock = Load(mode, concurrency, temperature), threading.Lock()
    deadline = time.monotonic() + timeout
    shares = [prompts[i::concurrency] for i in range(concurrency)]
    threads = [threading.Thread(target=_client, args=(stream_for(i), shares[i], load, lock, deadline)) for i in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    load.seconds = time.perf_counter() - t0
    return load


def sweep(bundle: Path, concurrency: list[int], temperatures: list[float], prompts: list[list[int]], tokens: int, requests: int,
          threads: int | None, timeout: float, report=print, synthetic: float | None = None) -> list[dict]:  # fmt: skip
    """Every mode at every concurrency and temperature, interleaved; returns the rows.
    ``synthetic``: cost only, draft tokens kept with that probability (specdec.commands.bench.synthetic)."""
    from specdec.commands.bench.synthetic import enable
    from specdec.runtime.batch import BatchEngine
    from specdec.runtime.decoder import SpeculativeDecoder

    single = SpeculativeDecoder.load(bundle, threads=threads)
    gamma = single.manifest.gamma
    rows = []
    for n in concurrency:
        forks = [single.fork() for _ in range(n)]
        with BatchEngine(bundle, max_batch=min(n, single.manifest.max_batch), threads=threads, max_queue=n * requests) as engine:
            if synthetic is not None:
                for owner in (engine, *forks):
                    enable(owner, synthetic)
            for t in temperatures:
                work = [prompts[i % len(prompts)] for i in range(n * requests)]
                kw = dict(max_new_tokens=tokens, temperature=t, ignore_eos=True)
                modes = {
                    "batched adaptive": lambda i: lambda p: engine.submit(p, gamma="auto", seed=i, **kw),
                    f"batched γ={gamma}": lambda i: lambda p: engine.submit(p, gamma=gamma, seed=i, **kw),
                    "batched plain": lambda i: lambda p: engine.submit(p, gamma=0, seed=i, **kw),
                    "fork per thread": lambda i: lambda p: forks[i].stream(p, gamma=gamma, seed=i, **kw),
                }
                for mode, stream_for in modes.items():
                    run_load(stream_for, mode, n, t, work[:n], timeout)  # warm-up: one request per client
                    rows.append({**run_load(stream_for, mode, n, t, work, timeout).row(), "synthetic_acceptance": synthetic})
                    report(rows[-1])
    return rows


def compared(level: list[dict], greedy: bool, plain: str | None, first: str) -> list[dict]:
    """One concurrency's rows (in the order they ran) with each server's tok/s over the ``plain``
    server's (the one run with --gamma 0, where there is one: ``vs_plain``) and, greedy, whether
    every reply equals the ``first`` server's token for token (``same_outputs``); the replies
    themselves are dropped."""
    plain = next((r for r in level if r["mode"] == plain), None)
    first = next(r for r in level if r["mode"] == first)["outputs"]
    for r in level:
        if plain is not None and plain["tok_s"] > 0:
            r["vs_plain"] = r["tok_s"] / plain["tok_s"]
        if greedy:
            r["same_outputs"] = all(r["outputs"].get(i) == ids for i, ids in first.items()) and r["outputs"].keys() == first.keys()
    for r in level:
        del r["outputs"]
    return level


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| T | clients | mode | aggregate tok/s | requests/s | per-request tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | requests | errors |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['temperature']:g} | {r['concurrency']} | {r['mode']} | {r['tok_s']:.0f} | {r['req_s']:.2f} | {r['per_request_tok_s']:.0f} | "
                     f"{r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} | {r['itl_p50_ms']:.2f} / {r['itl_p99_ms']:.2f} | {r['requests']} | {r.get('errors', 0)} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Aggregate throughput and p99 ITL against concurrency, one line per mode, one panel per
    temperature and metric; legend outside the data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(2, len(temps), figsize=(5 * len(temps) + 2.5, 7), squeeze=False)
    for j, t in enumerate(temps):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            sel = sorted((r for r in rows if r["mode"] == mode and r["temperature"] == t), key=lambda r: r["concurrency"])
            xs = [r["concurrency"] for r in sel]
            axes[0][j].plot(xs, [r["tok_s"] for r in sel], marker="o", label=mode)
            axes[1][j].plot(xs, [r["itl_p99_ms"] for r in sel], marker="o", label=mode)
        axes[0][j].set(title=f"T={t:g}: aggregate throughput", xlabel="concurrent clients", ylabel="tokens/s", xscale="log", xticks=xs)
        axes[1][j].set(title=f"T={t:g}: inter-token latency p99", xlabel="concurrent clients", ylabel="ms", xscale="log", xticks=xs)
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xticklabels([str(x) for x in xs])
            ax.set_ylim(bottom=0)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right")
    fig.tight_layout(rect=(0, 0, 0.8, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)

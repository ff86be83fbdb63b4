"""``specdec bench-serve``: servers side by side on 127.0.0.1 under one bounded client load.

Servers (``--server NAME=ARGS``, ARGS being ``specdec serve`` options; default: the bundle's γ,
adaptive γ and plain decoding) start at once on free loopback ports, each also from another tree
with ``--old DIR``. At every concurrency they run one after another, the order alternating, so
machine drift hits them alike. A run is ``--requests`` units of work taken in turn by
``concurrency`` client tasks and bounded by ``--timeout``: a unit is one streamed request
(``--n K``: K choices, as one JSON body), or with ``--turns N`` a conversation whose every turn
sends the history plus a new user turn (token ids, or ``--chat`` messages) and reads the reply.
The client measures requests/s, tokens/s, time to first token and inter-token latency (from the
SSE chunks), errors, TTFT per turn and the prefix-cache hit rate (from /metrics), and the CPU each
run took: the client's (this process) and the server's process tree's (psutil). At one request
at a time, each server is also compared with an in-process ``BatchEngine`` of its options: what
the HTTP layer costs (``--overhead-rounds``; ``--no-overhead`` skips it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import shlex
import statistics
import tempfile
import time
from pathlib import Path

import click

from specdec.commands.bench.load import Load, compared, markdown, plot, run_load
from specdec.errors import ConfigError, InputError

RESERVED = ("host", "port", "served_model_name")  # the benchmark sets these


@dataclasses.dataclass(frozen=True)
class Traffic:
    """What every request of a run asks for."""

    tokens: int
    temperature: float
    turns: int = 1
    n: int = 1
    chat: bool = False
    timeout: float = 300.0


def parse_servers(specs: tuple[str, ...] | list[str]) -> dict[str, tuple[list[str], dict]]:
    """NAME -> (``specdec serve`` options, their parsed values) of each ``--server NAME=ARGS``; the
    name ends at the first ``=`` followed by an option or by nothing (so ``γ=4=--gamma 4`` works)."""
    from click.core import ParameterSource

    from specdec.commands.cli.serve import serve_cmd

    out: dict[str, tuple[list[str], dict]] = {}
    for spec in specs:
        found = re.fullmatch(r"(.+?)=(?=-|$)(.*)", spec, re.S)
        if not found or found[1].strip() != found[1]:
            raise ConfigError(f"--server {spec!r}: expected NAME=ARGS, ARGS being specdec serve options (NAME= for the defaults), "
                              "such as 'plain=--gamma 0'")  # fmt: skip
        name = found[1]
        try:
            args = shlex.split(found[2])
            ctx = serve_cmd.make_context("specdec serve", ["BUNDLE", *args])
        except ValueError as e:
            raise ConfigError(f"--server {spec!r}: {e}") from None
        except click.ClickException as e:
            raise ConfigError(f"--server {spec!r}: {e.format_message()}") from None
        fixed = [p for p in RESERVED if ctx.get_parameter_source(p) == ParameterSource.COMMANDLINE]
        if fixed or name in out:
            why = f"--{fixed[0].replace('_', '-')} is set by bench-serve" if fixed else f"a second server named {name!r}"
            raise ConfigError(f"--server {spec!r}: {why}")
        out[name] = (args, ctx.params)
    return out


async def send(client, route: str, body: dict, load: Load) -> tuple[float, list[int], str] | None:
    """One request, its tokens counted in ``load``: (TTFT, choice 0's ids, its text); None when it failed."""
    import httpx

    t0, arrivals, ids, text = time.perf_counter(), [], [], []
    try:
        if not body["stream"]:
            r = await client.post(route, json=body)
            if r.status_code != 200:
                load.errors += 1
                return None
            got = r.json()
            arrivals.append((time.perf_counter(), got["usage"]["completion_tokens"]))
            first = got["choices"][0]
            ids, text = first.get("token_ids") or [], [first.get("text") or (first.get("message") or {}).get("content") or ""]
        else:
            async with client.stream("POST", route, json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    load.errors += 1
                    return None
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        load.errors += 1
                        return None
                    choice = (chunk.get("choices") or [{}])[0]
                    new = choice.get("token_ids") or []
                    arrivals.append((time.perf_counter(), len(new)))
                    ids += new
                    text.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
    except httpx.HTTPError:
        load.errors += 1
        return None
    load.add(t0, arrivals)
    return next((t - t0 for t, n in arrivals if n), 0.0), ids, "".join(text)


async def conversation(client, seed: int, users: list[list[int]], tr: Traffic, codec, load: Load, per_turn: list[list[float]], stream: bool,
                       outputs: list[list[int]] | None = None) -> None:  # fmt: skip
    """One unit of work: its turns in order, each the history plus the next user turn (each reply's
    ids into ``outputs``); stops at an error."""
    history: list = []  # token ids, or messages (--chat)
    for t, user in enumerate(users):
        history += [{"role": "user", "content": codec.decode(user)}] if tr.chat else user
        body = {"model": "bench", "max_tokens": tr.tokens, "temperature": tr.temperature, "seed": seed, "ignore_eos": True, "n": tr.n,
                "stream": stream, "return_token_ids": True, "messages" if tr.chat else "prompt": list(history)}  # fmt: skip
        got = await send(client, "/v1/chat/completions" if tr.chat else "/v1/completions", body, load)
        if got is None:
            return
        per_turn[t].append(got[0])
        if outputs is not None:
            outputs.append(got[1])
        history += [{"role": "assistant", "content": got[2]}] if tr.chat else got[1]


async def prefix_counts(client) -> tuple[float, float]:
    """(queries, hits) of the server's prefix cache, from /metrics (0, 0 where it has none)."""
    from prometheus_client.parser import text_string_to_metric_families

    r = await client.get("/metrics")
    got = {s.name: s.value for fam in text_string_to_metric_families(r.text) for s in fam.samples} if r.status_code == 200 else {}
    return got.get("specdec_prefix_cache_queries_total", 0.0), got.get("specdec_prefix_cache_hits_total", 0.0)


async def served(url: str, name: str, concurrency: int, units: list[list[list[int]]], tr: Traffic, codec, stream: bool = True) -> dict:
    """``concurrency`` client tasks take the units in turn; bounded by their count and ``tr.timeout``."""
    import httpx

    load, todo, per_turn = Load(name, concurrency, tr.temperature), list(enumerate(units)), [[] for _ in range(tr.turns)]
    outputs: dict[int, list[list[int]]] = {}  # unit -> each turn's reply ids

    async def worker(client):
        while todo:
            i, users = todo.pop(0)
            await conversation(client, i, users, tr, codec, load, per_turn, stream and tr.n == 1, outputs.setdefault(i, []))

    async with httpx.AsyncClient(base_url=url, timeout=tr.timeout, limits=httpx.Limits(max_connections=concurrency)) as client:
        q0, h0 = await prefix_counts(client)
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.gather(*(worker(client) for _ in range(concurrency))), tr.timeout)
        except asyncio.TimeoutError:
            click.echo(f"  {name} c={concurrency}: stopped at the {tr.timeout:g} s bound", err=True)
        load.seconds = time.perf_counter() - t0
        q1, h1 = await prefix_counts(client)
    return {**load.row(), "prefix_hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
            "turn_ttft_ms": [1e3 * statistics.median(x) if x else 0.0 for x in per_turn], "outputs": outputs}  # fmt: skip


def http_overhead(bundle: Path, gamma: int, servers: dict, urls: dict, work: list[list[list[int]]], tr: Traffic, rounds: int) -> list[dict]:
    """Per server of this tree, ``rounds`` rounds of the same requests on an in-process
    ``BatchEngine`` with its options, then served streamed, then served as one JSON body, back to back."""
    from specdec.runtime.batch import BatchEngine

    tr, out = dataclasses.replace(tr, turns=1, n=1, chat=False), []
    for name, (_, p) in servers.items():
        g = gamma if p["gamma"] is None else p["gamma"] if p["gamma"] == "auto" else int(p["gamma"])
        opts = {k: p[k] for k in ("max_batch", "drafter", "threads", "provider", "prefix_reuse", "cache_slots")}
        with BatchEngine(bundle, max_queue=len(work), **opts) as engine:
            stream_for = lambda i: lambda u: engine.submit(u[0], max_new_tokens=tr.tokens, temperature=tr.temperature, seed=i, gamma=g, ignore_eos=True)  # noqa: E731
            run_load(stream_for, "warm-up", 1, tr.temperature, work[:1], tr.timeout)
            got = []
            for _ in range(rounds):
                inproc = run_load(stream_for, "in-process", 1, tr.temperature, work, tr.timeout).row()["tok_s"]
                streamed = asyncio.run(served(urls[name], "streamed", 1, work, tr, None))["tok_s"]
                got.append((inproc, streamed, asyncio.run(served(urls[name], "whole", 1, work, tr, None, stream=False))["tok_s"]))
        out.append({"mode": name, "rounds": got, "streamed_ratio": [x[1] / x[0] for x in got], "whole_ratio": [x[2] / x[0] for x in got]})
        click.echo(f"  {name}: in-process / streamed / whole tok/s per round: {[tuple(round(v) for v in x) for x in got]}", err=True)
    return out


def start(bundle: Path, servers: dict, old: Path | None, max_queue: int, logs: Path) -> dict:
    """Name -> ready ``ServerProcess``; with ``old``, each server also from that tree, as NAME (old).
    A server that does not start is a ``ConfigError`` naming its log's last line (the others are closed)."""
    from specdec.serve.process import ServerProcess

    env = {k: v for k, v in os.environ.items() if k != "SPECDEC_API_KEY"}  # the client sends no key
    common = ("--served-model-name", "bench", "--log-level", "warning", "--max-queue", str(max_queue))  # ARGS may override the last two
    procs = {}
    try:
        for i, (name, (args, _)) in enumerate(servers.items()):
            tag = re.sub(r"\W+", "-", name).strip("-")
            procs[name] = ServerProcess(bundle, *common, *args, log=logs / f"{i}-{tag}.log", env=env)
            if old is not None:
                procs[f"{name} (old)"] = ServerProcess(bundle, *common, *args, log=logs / f"{i}-{tag}-old.log", env={**env, "PYTHONPATH": str(old)}, cwd=old)
        for name, s in procs.items():
            try:
                s.wait_ready()
            except RuntimeError:
                last = next((ln for ln in reversed(s.log.read_text().splitlines()) if ln.strip()), "no output")
                raise ConfigError(f"server {name!r} did not start ({s.log}): {last.strip()}") from None
    except BaseException:
        stop(procs)
        raise
    return procs


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` and its descendants so far (a Ray server's
    raylet and replicas included); None without psutil (``pip install 'specdec[bench]'``)."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0.0
    for proc in tree:
        with contextlib.suppress(psutil.Error):  # one that ended meanwhile
            t = proc.cpu_times()
            total += t.user + t.system
    return total


def measured(s, name: str, c: int, units: list, tr: Traffic, codec) -> dict:
    """One run of ``served``, with the CPU it took: this process's (the client's) and the server's
    process tree's, as cores busy over the run and ms of CPU a token. On one box they share the
    cores: a client near a core tells the run measures the load generator too."""
    wall0, client0, server0 = time.perf_counter(), time.process_time(), cpu_seconds(s.proc.pid)
    row = asyncio.run(served(s.url, name, c, units, tr, codec))
    wall, client, server = time.perf_counter() - wall0, time.process_time() - client0, cpu_seconds(s.proc.pid)
    tokens = max(row["tokens"], 1)
    row.update(client_cores=client / wall, client_cpu_ms_per_token=1e3 * client / tokens)
    if server is not None and server0 is not None:
        row.update(server_cores=(server - server0) / wall, server_cpu_ms_per_token=1e3 * (server - server0) / tokens)
    return row


def stop(procs: dict) -> None:
    """SIGTERM to every server at once, then wait (a Ray server shuts Ray down: give it time); kill what is left."""
    import subprocess

    for s in procs.values():
        if s.proc.poll() is None:
            s.proc.terminate()
    for s in procs.values():
        try:
            s.proc.wait(90)
        except subprocess.TimeoutExpired:
            s.close()


def bench_serve(bundle: Path, server: tuple[str, ...], old: Path | None, concurrency: str, requests: int, prompt_tokens: int, tokens: int,
                temperature: float, distinct: bool, turns: int, n: int, chat: bool, timeout: float, overhead: bool, overhead_rounds: int,
                overhead_requests: int, out: Path | None) -> None:  # fmt: skip
    from specdec.commands.bench import held_out_prompts
    from specdec.commands.bench.report import write_results
    from specdec.commands.cli.options import parse_numbers
    from specdec.manifest import load_manifest
    from specdec.runtime.text import TextCodec

    levels = parse_numbers("--concurrency", concurrency, int)
    for opt, value in (("--requests", requests), ("--prompt-tokens", prompt_tokens), ("--tokens", tokens), ("--turns", turns), ("--n", n),
                       ("--overhead-rounds", overhead_rounds), ("--overhead-requests", overhead_requests), *(("--concurrency", c) for c in levels)):  # fmt: skip
        if value < 1:
            raise InputError(f"{opt} {value}: expected an integer >= 1")
    if not levels or temperature < 0 or timeout <= 0:
        raise InputError(f"--concurrency {concurrency!r}, --temperature {temperature:g}, --timeout {timeout:g}: expected numbers >= 1, >= 0, > 0")
    if old is not None and not (old / "specdec").is_dir():
        raise InputError(f"--old {old}: expected a folder holding another tree's specdec package")
    bundle, old, servers = bundle.resolve(), old.resolve() if old else None, parse_servers(server)
    m = load_manifest(bundle)
    codec = TextCodec.from_bundle(bundle, m)
    if codec is None:
        raise InputError(f"bundle {bundle} has no tokenizer; specdec bench-serve draws its prompts from text")
    servers = servers or parse_servers([f"γ={m.gamma}=--gamma {m.gamma}", "adaptive γ=--gamma auto", "plain (γ=0)=--gamma 0"])
    distinct = distinct or turns > 1  # conversations never share a user turn
    pool = held_out_prompts(lambda s: codec.encode(s, turns == 1), turns * requests + max(levels) if distinct else 8, prompt_tokens)
    if not pool:
        raise InputError(f"--prompt-tokens {prompt_tokens}: no held-out prompt is that long")
    units = [[pool[(i * turns + t) % len(pool)] for t in range(turns)] for i in range(requests)]
    warm = [[pool[(turns * requests + k) % len(pool)]] for k in range(max(levels))] if distinct else units  # --distinct: no prompt sent twice
    tr = Traffic(tokens, temperature, turns, n, chat, timeout)
    logs = Path(tempfile.mkdtemp(prefix="specdec-bench-serve-"))
    click.echo(f"server logs in {logs}", err=True)
    plain = next((k for k, (_, p) in servers.items() if p["gamma"] == "0"), None)  # the plain-decoding server the others are set against
    procs, rows = start(bundle, servers, old, max(64, 2 * max(levels)), logs), []
    try:
        for li, c in enumerate(levels):
            level = []
            for name, s in list(procs.items())[:: 1 if li % 2 == 0 else -1]:
                asyncio.run(served(s.url, name, c, warm[:c], tr, codec))  # warm-up: one unit per client
                level.append(r := measured(s, name, c, units, tr, codec))
                click.echo(f"{name:>22} c={c:<3} {r['tok_s']:7.0f} tok/s {r['req_s']:6.2f} req/s  TTFT p50 {r['ttft_p50_ms']:.1f} ms  "
                           f"ITL p99 {r['itl_p99_ms']:.2f} ms  hit rate {r['prefix_hit_rate']:.2f}  errors {r['errors']}  "
                           f"CPU client {r['client_cores']:.2f} / server {r.get('server_cores', float('nan')):.2f} cores", err=True)  # fmt: skip
            rows += compared(level, temperature == 0 and n == 1, plain, first=list(procs)[0])
        urls = {name: procs[name].url for name in servers}
        work = [[p] for p in pool][:overhead_requests]
        costs = http_overhead(bundle, m.gamma, servers, urls, work, tr, overhead_rounds) if overhead else []
    finally:
        stop(procs)

    md = report(bundle, m, servers, old, rows, costs, tr, (requests, prompt_tokens, distinct, levels))
    click.echo(md)
    data = {"rows": rows, "overhead": costs, "servers": {k: a for k, (a, _) in servers.items()}, "old": str(old) if old else None}
    write_results(out, md, data, plot=lambda path: plot(rows, path.with_name("load.png")))


def report(bundle: Path, m, servers: dict, old: Path | None, rows: list[dict], costs: list[dict], tr: Traffic, run: tuple) -> str:
    """bench-serve's tables: the runs, the CPU they took, per-turn TTFT, this tree against --old, the HTTP layer's cost."""
    requests, prompt_tokens, distinct, levels = run
    tokens, temperature, turns, n, chat = tr.tokens, tr.temperature, tr.turns, tr.n, tr.chat
    shape = (f"conversations of {turns} turns ({prompt_tokens} user + {tokens} reply tokens each, "
             f"{'chat messages through the template' if chat else 'token ids on /v1/completions'})" if turns > 1 else
             f"requests of {prompt_tokens} prompt + {tokens} new tokens{', each its own prompt' if distinct else ''}")  # fmt: skip
    listed = "; ".join(f"{k}: `{shlex.join(a) or 'defaults'}`" for k, (a, _) in servers.items())
    header = (f"bundle {bundle.name}: max-batch {m.max_batch}, γ {m.gamma}; {requests} {shape} per run, held-out stdlib prompts, EOS ignored, "
              f"T={temperature:g}, {f'n={n} choices, one JSON body each (TTFT = the whole response)' if n > 1 else 'streamed'}; servers "
              f"{listed}{' (and each from --old)' if old else ''}, "
              "on 127.0.0.1, interleaved at each concurrency (order alternating); latencies measured by the client")  # fmt: skip
    md = markdown(rows, header)
    if any("vs_plain" in r or "same_outputs" in r for r in rows):
        md += ("\nEach server against plain decoding (the --gamma 0 server's tok/s in the same interleaved round) and, greedy, whether "
               "every reply equals the first server's token for token:\n\n| clients | server | tok/s / plain | outputs equal |\n|---:|---|---:|---|\n")  # fmt: skip
        md += "".join(f"| {r['concurrency']} | {r['mode']} | {r.get('vs_plain', float('nan')):.2f} | "
                      f"{'-' if 'same_outputs' not in r else 'yes' if r['same_outputs'] else '**no**'} |\n" for r in rows)  # fmt: skip
    md += ("\nCPU over each run: the client (this benchmark's process) and the server (its process tree), cores busy and ms of "
           f"CPU a token, on this box's {os.cpu_count()} cores:\n\n| clients | server | client cores | client ms a token | server cores | "
           "server ms a token |\n|---:|---|---:|---:|---:|---:|\n")  # fmt: skip
    md += "".join(f"| {r['concurrency']} | {r['mode']} | {r['client_cores']:.2f} | {r['client_cpu_ms_per_token']:.3f} | "
                  f"{r.get('server_cores', float('nan')):.2f} | {r.get('server_cpu_ms_per_token', float('nan')):.3f} |\n" for r in rows)  # fmt: skip
    if turns > 1:
        md += ("\nPer conversation turn: median time to first token, and the prefix-cache hit rate over the run (/metrics):\n\n"
               "| clients | server | prefix hit rate | TTFT turn 1 ms | median TTFT turns 2+ ms | TTFT last turn ms |\n|---:|---|---:|---:|---:|---:|\n")  # fmt: skip
        md += "".join(f"| {r['concurrency']} | {r['mode']} | {r['prefix_hit_rate']:.2f} | {r['turn_ttft_ms'][0]:.0f} | "
                      f"{statistics.median(r['turn_ttft_ms'][1:]):.0f} | {r['turn_ttft_ms'][-1]:.0f} |\n" for r in rows)  # fmt: skip
    if old:  # a level given twice (--concurrency 1,1,1: old and new alternated run by run) counts its runs' median
        tok = lambda k, c: statistics.median([r["tok_s"] for r in rows if r["mode"] == k and r["concurrency"] == c])  # noqa: E731
        md += "\nThis tree / old, tok/s (median over runs): " + ", ".join(f"{k} c={c} {tok(k, c) / max(tok(f'{k} (old)', c), 1e-9):.2f}"
                                                                         for c in dict.fromkeys(levels) for k in servers) + "\n"  # fmt: skip
    if costs:
        md += ("\nHTTP layer, one request at a time: per round, the same requests on an in-process BatchEngine with the server's options, "
               "then served streamed (SSE), then served as one JSON body, back to back; served / in-process tok/s, median (range) over "
               "the rounds:\n\n| server | in-process tok/s (median) | served streamed / in-process | served whole / in-process |\n|---|---:|---:|---:|\n")  # fmt: skip
        span = lambda xs: f"{statistics.median(xs):.2f} ({min(xs):.2f}–{max(xs):.2f})"  # noqa: E731
        md += "".join(f"| {o['mode']} | {statistics.median(x[0] for x in o['rounds']):.0f} | {span(o['streamed_ratio'])} | {span(o['whole_ratio'])} |\n" for o in costs)
    return md


@click.command("bench-serve")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--server", multiple=True, metavar="NAME=ARGS", help="A server to measure: its name and `specdec serve` options, e.g. "
              "'plain=--gamma 0', 'no reuse=--no-prefix-reuse', 'ray x2=--ray --replicas 2' (repeat) [default: the bundle's γ, auto, 0].")
@click.option("--old", default=None, type=click.Path(file_okay=False, path_type=Path),
              help="A folder holding another tree's specdec package: each server also runs from it (PYTHONPATH), interleaved with this tree's.")
@click.option("--concurrency", default="1,4,8,16", show_default=True, help="Comma-separated numbers of concurrent clients.")
@click.option("--requests", default=32, show_default=True, type=int, help="Requests (with --turns: conversations) per server and concurrency.")
@click.option("--prompt-tokens", default=64, show_default=True, type=int, help="Prompt tokens (with --turns: per user turn).")
@click.option("--tokens", default=128, show_default=True, type=int, help="New tokens per request (EOS ignored).")
@click.option("--temperature", default=0.0, show_default=True, type=float)
@click.option("--distinct", is_flag=True, help="Every request its own prompt, warm-ups included (single-turn traffic: nothing for prefix reuse to keep).")
@click.option("--turns", default=1, show_default=True, type=int, help="> 1: multi-turn conversations, each turn sending the history plus a new user turn.")
@click.option("--n", "n", default=1, show_default=True, type=int, help="Choices per request; > 1 sends them non-streamed (one JSON body).")
@click.option("--chat", is_flag=True, help="Messages on /v1/chat/completions through the chat template, replies sent back as text (instead of token ids).")
@click.option("--timeout", default=300.0, show_default=True, type=float, help="Seconds a run may take before its clients stop.")
@click.option("--overhead/--no-overhead", default=True, show_default=True, help="Compare each server with an in-process BatchEngine, one request at a time.")
@click.option("--overhead-rounds", default=3, show_default=True, type=int, help="Rounds of that comparison (this box drifts).")
@click.option("--overhead-requests", default=16, show_default=True, type=int, help="Requests per round of that comparison.")
@click.option("--isolation", default=None, type=int, metavar="TRIALS", help="Instead: time tenant isolation (--isolate-tenants against "
              "shared prefix reuse), TRIALS interleaved trials of a --prompt-tokens prompt through the official openai client.")
@click.option("--out", default=None, type=click.Path(file_okay=False, path_type=Path), help="Write results.md, results.json and load.png here.")
def bench_serve_cmd(isolation: int | None, **kw) -> None:
    """`specdec serve` under load: servers side by side, interleaved, measured by the client."""
    if isolation is not None:
        from specdec.commands.bench.isolation import bench_isolation

        return bench_isolation(kw["bundle"].resolve(), isolation, kw["prompt_tokens"], kw["out"])
    bench_serve(**kw)

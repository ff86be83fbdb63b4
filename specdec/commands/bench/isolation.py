"""``specdec bench-serve BUNDLE --isolation N``: what one tenant's time to first token tells about another's prompts.

Two servers on 127.0.0.1, each with two API keys (tenants A and B): ``isolated`` with
``--isolate-tenants``, and ``shared`` without it (the control: prefix reuse across tenants). In
each of N trials, on each server in turn, a fresh random prompt of ``--prompt-tokens`` ids goes,
streamed with one new token, through the official ``openai`` client:

    cold    tenant X sends it first: nothing of it is cached
    other   tenant Y sends the same prompt: isolated, it is fed whole, as cold
    same    tenant X sends it again: its own prefix is kept

X and Y swap each trial. The prefix-hit counter (/metrics) is read around every request. The
report: median time to first token of each (with the quartiles), other / cold per trial, the
share of trials where other beat cold (near 1/2 when they cannot be told apart), and the hits.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

KEYS = ("tenant-a-key", "tenant-b-key")
KINDS = ("cold", "other", "same")


def hits(http, url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = http.get(url + "/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"}).text
    return next(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == "specdec_prefix_cache_hits_total")


def ttft(client, prompt: list[int]) -> float:
    """Seconds to the first streamed chunk of one new token."""
    t0 = time.perf_counter()
    for chunk in client.completions.create(model="bench", prompt=prompt, max_tokens=1, temperature=0, stream=True):
        if chunk.choices:
            return time.perf_counter() - t0
    raise RuntimeError("the stream ended without a chunk")


def trials(urls: dict[str, str], n: int, length: int, vocab: int, seed: int = 0) -> dict:
    """Per server: per kind, the TTFTs (s) and prefix hits (tokens) of ``n`` interleaved trials."""
    import httpx
    import openai

    rng = np.random.default_rng(seed)
    out = {name: {k: {"ttft": [], "hits": []} for k in KINDS} for name in urls}
    clients = {name: [openai.OpenAI(base_url=url + "/v1", api_key=k, max_retries=0, timeout=120) for k in KEYS] for name, url in urls.items()}
    with httpx.Client(timeout=30) as http:
        for name, url in urls.items():  # warm every graph of a prompt this long, on a prompt no trial sends
            ttft(clients[name][0], [int(t) for t in rng.integers(3, vocab, length)])
        for i in range(n):
            for name in list(urls)[:: 1 if i % 2 == 0 else -1]:
                prompt = [int(t) for t in rng.integers(3, vocab, length)]  # [length]: nothing cached starts like it
                x, y = clients[name][i % 2], clients[name][1 - i % 2]
                for kind, client in zip(KINDS, (x, y, x)):
                    h0 = hits(http, urls[name])
                    out[name][kind]["ttft"].append(ttft(client, prompt))
                    out[name][kind]["hits"].append(hits(http, urls[name]) - h0)
    return out


def report(got: dict, n: int, length: int) -> tuple[str, list[dict]]:
    rows = []
    for name, kinds in got.items():
        cold, other = kinds["cold"]["ttft"], kinds["other"]["ttft"]
        for kind in KINDS:
            t = sorted(1e3 * x for x in kinds[kind]["ttft"])
            q = statistics.quantiles(t, n=4) if len(t) > 1 else [t[0]] * 3
            rows.append({"server": name, "kind": kind, "ttft_ms_p25": q[0], "ttft_ms_p50": q[1], "ttft_ms_p75": q[2],
                         "hits": sum(kinds[kind]["hits"]), "trials": len(t)})  # fmt: skip
        rows[-2].update(other_over_cold=statistics.median(o / c for o, c in zip(other, cold)), other_faster_share=float(np.mean([o < c for o, c in zip(other, cold)])))
    md = (f"{n} interleaved trials per server, each a fresh random prompt of {length} token ids, one new token, streamed through the official "
          "openai client; tenants A and B alternate as the first sender. isolated: `--isolate-tenants`; shared: the same two keys without it.\n\n"
          "| server | request | TTFT p50 ms (p25–p75) | prefix hits (tokens, all trials) | other / cold (median per trial) | trials where other < cold |\n"
          "|---|---|---:|---:|---:|---:|\n")  # fmt: skip
    for r in rows:
        extra = f"{r['other_over_cold']:.3f} | {r['other_faster_share']:.2f}" if "other_over_cold" in r else " | "
        md += f"| {r['server']} | {r['kind']} | {r['ttft_ms_p50']:.1f} ({r['ttft_ms_p25']:.1f}–{r['ttft_ms_p75']:.1f}) | {r['hits']:.0f} | {extra} |\n"
    return md, rows


def bench_isolation(bundle, n: int, length: int, out) -> None:
    """Run the trials on two servers of ``bundle`` (started here, stopped after) and write the report."""
    import os
    import tempfile
    from pathlib import Path

    import click

    from specdec.commands.bench.report import write_results
    from specdec.errors import InputError
    from specdec.manifest import load_manifest
    from specdec.serve.process import ServerProcess

    m = load_manifest(bundle)
    if not 1 <= length < m.max_seq_len or n < 2:
        raise InputError(f"--isolation {n} --prompt-tokens {length}: expected >= 2 trials and a prompt of 1..{m.max_seq_len - 1} tokens (the bundle's max_seq_len)")
    logs = Path(tempfile.mkdtemp(prefix="specdec-bench-isolation-"))
    env = {k: v for k, v in os.environ.items() if k != "SPECDEC_API_KEY"}  # the keys are the arguments
    keys = [a for k in KEYS for a in ("--api-key", k)]
    common = ("--served-model-name", "bench", "--log-level", "warning", *keys)
    procs = {}
    try:
        for name, extra in (("isolated", ("--isolate-tenants",)), ("shared", ())):
            procs[name] = ServerProcess(bundle, *common, *extra, log=logs / f"{name}.log", env=env)
        for s in procs.values():
            s.wait_ready()
        got = trials({name: s.url for name, s in procs.items()}, n, length, m.vocab_size)
    finally:
        for s in procs.values():
            s.close()
    md, rows = report(got, n, length)
    md = f"bundle {Path(bundle).name}: prefix-cache isolation between tenants\n\n" + md
    click.echo(md)
    write_results(out, md, {"rows": rows, "trials": n, "prompt_tokens": length})

"""Multi-turn conversations against ``specdec serve``, with prefix reuse and without.

    python tools/bench_multiturn.py BUNDLE [--turns 6] [--concurrency 1,8] [--chat] [--out docs/bench/multiturn]

Two servers on 127.0.0.1: one with prefix reuse (the default), one with ``--no-prefix-reuse``.
A conversation is ``--turns`` turns: each sends the whole history plus a new user turn of
``--user-tokens`` held-out tokens and streams a reply of ``--reply-tokens`` (greedy, EOS
ignored), so the history grows by user + reply tokens a turn. ``--concurrency`` conversations
run at once (each its turns in order); at each concurrency the two servers run one after the
other, the order alternating. Reported per turn: median time to first token (client-side, from
the SSE chunks); per run: total seconds and the prefix-cache hit rate read from /metrics
(hits / queries over the run).

Two ways to build the history:
- default: token ids on /v1/completions (prompt = history ids + reply ids + next user ids),
  what a client holding the ids sends; every turn's prompt starts with the last one's.
- ``--chat``: messages on /v1/chat/completions, rendered by the chat template (the bundle's or
  ``--chat-template FILE``), the reply sent back as text: measures where a template or
  re-tokenizing the reply breaks the shared prefix.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from specdec.bench import held_out_prompts
from specdec.manifest import load_manifest
from specdec.runtime.text import TextCodec
from specdec.serve.process import ServerProcess


def prefix_counts(url: str) -> tuple[float, float]:
    """(queries, hits) of the server's prefix cache, from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    got = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            got[s.name] = s.value
    return got.get("specdec_prefix_cache_queries_total", 0.0), got.get("specdec_prefix_cache_hits_total", 0.0)


async def turn(client: httpx.AsyncClient, a, history, chat: bool) -> tuple[float, list[int], str]:
    """One streamed turn: (seconds to the first token, reply ids, reply text)."""
    body = {"model": "bench", "max_tokens": a.reply_tokens, "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
    body.update({"messages": history} if chat else {"prompt": history})
    route = "/v1/chat/completions" if chat else "/v1/completions"
    t0, first, ids, text = time.perf_counter(), None, [], []
    async with client.stream("POST", route, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{route}: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choice = (json.loads(line[6:]).get("choices") or [{}])[0]
            new = choice.get("token_ids") or []
            if new and first is None:
                first = time.perf_counter() - t0
            ids += new
            text.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
    return first or 0.0, ids, "".join(text)


async def conversation(client, a, users: list[list[int]], codec, chat: bool, ttfts: list[list[float]]) -> None:
    history: list = []  # messages (--chat) or token ids
    for t, user in enumerate(users):
        if chat:
            history.append({"role": "user", "content": codec.decode(user)})
        else:
            history += user
        ttft, ids, text = await turn(client, a, history, chat)
        ttfts[t].append(ttft)
        if chat:
            history.append({"role": "assistant", "content": text})
        else:
            history += ids


async def run(url: str, a, convs: list[list[list[int]]], codec, chat: bool) -> dict:
    ttfts: list[list[float]] = [[] for _ in range(a.turns)]
    q0, h0 = prefix_counts(url)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=a.timeout, limits=httpx.Limits(max_connections=len(convs))) as client:
        await asyncio.wait_for(asyncio.gather(*(conversation(client, a, users, codec, chat, ttfts) for users in convs)), a.timeout)
    seconds = time.perf_counter() - t0
    q1, h1 = prefix_counts(url)
    return {"seconds": seconds, "ttft_ms": [1000 * statistics.median(x) for x in ttfts], "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
            "later_ttft_ms": 1000 * statistics.median([v for x in ttfts[1:] for v in x])}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--user-tokens", type=int, default=150)
    ap.add_argument("--reply-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--chat", action="store_true", help="messages through the chat template instead of token ids")
    ap.add_argument("--chat-template", type=Path, default=None)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    bundle = a.bundle.resolve()
    m = load_manifest(bundle)
    codec = TextCodec.from_bundle(bundle, m)
    levels = [int(x) for x in a.concurrency.split(",")]
    pool = held_out_prompts(lambda s: codec.encode(s, False), a.turns * max(levels), a.user_tokens)
    logs = Path(tempfile.mkdtemp(prefix="specdec-bench-multiturn-"))
    extra = ("--chat-template", str(a.chat_template)) if a.chat_template else ()
    common = ("--served-model-name", "bench", "--log-level", "warning", "--max-queue", "64", *extra)
    servers = {"reuse": ServerProcess(bundle, *common, log=logs / "reuse.log"),
               "no reuse": ServerProcess(bundle, *common, "--no-prefix-reuse", log=logs / "cold.log")}  # fmt: skip
    rows = []
    try:
        for s in servers.values():
            s.wait_ready()
        for i, c in enumerate(levels):
            convs = [[pool[(k * a.turns + t) % len(pool)] for t in range(a.turns)] for k in range(c)]
            order = list(servers) if i % 2 == 0 else list(servers)[::-1]
            for name in order:
                r = asyncio.run(run(servers[name].url, a, convs, codec, a.chat))
                rows.append({"mode": name, "conversations": c, **r})
                print(f"{name:>9} c={c}: {r['seconds']:.1f} s, hit rate {r['hit_rate']:.2f}, TTFT per turn (ms) "
                      f"{[round(x, 1) for x in r['ttft_ms']]}", file=sys.stderr)  # fmt: skip
    finally:
        for s in servers.values():
            s.close()
    history = a.turns * (a.user_tokens + a.reply_tokens)
    md = (f"bundle {bundle}: {a.turns} turns of {a.user_tokens} user + {a.reply_tokens} reply tokens (history up to ~{history} tokens), "
          f"{'chat messages through the template' if a.chat else 'token ids on /v1/completions'}, greedy; one server with prefix reuse, "
          "one without, alternating at each concurrency; TTFT from the SSE chunks\n\n"
          "| conversations | mode | total s | prefix hit rate | TTFT turn 1 ms | median TTFT turns 2+ ms | TTFT last turn ms |\n|---:|---|---:|---:|---:|---:|---:|\n")  # fmt: skip
    md += "".join(f"| {r['conversations']} | {r['mode']} | {r['seconds']:.1f} | {r['hit_rate']:.2f} | {r['ttft_ms'][0]:.0f} | {r['later_ttft_ms']:.0f} | "
                  f"{r['ttft_ms'][-1]:.0f} |\n" for r in rows)  # fmt: skip
    ratios = {c: next(r["later_ttft_ms"] for r in rows if r["conversations"] == c and r["mode"] == "reuse")
              / next(r["later_ttft_ms"] for r in rows if r["conversations"] == c and r["mode"] == "no reuse") for c in levels}  # fmt: skip
    md += "\nMedian TTFT of turns 2+, reuse / no reuse: " + ", ".join(f"{c} conversation(s) {x:.2f}" for c, x in ratios.items()) + "\n"
    print(md)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        name = "chat" if a.chat else "ids"
        (a.out / f"{name}.md").write_text(md)
        (a.out / f"{name}.json").write_text(json.dumps({"rows": rows, "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()

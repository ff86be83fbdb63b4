"""One request's output: ``Generation`` reads a handle's pieces (stop strings, the metrics'
timings, cancelling a request its reader left), and the answer is assembled from it: the whole
body (``usage``, ``best`` of best_of, ``metrics.speculative_decoding`` where asked) or server-sent events (``sse``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import AsyncIterator

from specdec.runtime.handles import Handle
from specdec.runtime.text import TextCodec
from specdec.serve.metrics import Metrics
from specdec.serve.stops import StopStrings

log = logging.getLogger("specdec.serve")
clock = time.perf_counter


class Generation:
    """Reads a handle's pieces on the event loop: applies stop strings, times tokens for the
    metrics, and ends the request (cancelling it in the engine) when the reader stops early."""

    def __init__(self, handle: Handle, stops: list[str], arrival: float, metrics: Metrics):
        self.handle, self.arrival, self.metrics = handle, arrival, metrics
        self.stops = StopStrings(stops) if stops else None
        self.finish: str | None = None  # OpenAI finish_reason once ended: "stop", "length" (or "abort")
        self.last: float | None = None
        self.ids: list[int] = []  # the tokens returned: up to the one that completed a stop string

    async def deltas(self) -> AsyncIterator[tuple[str, list[int], list]]:
        """(text, tokens, their TokenLogprobs or None) as the engine accepts them; ``finish`` is
        set when this ends normally. With stop strings, tokens whose text is held back (an
        incomplete character, or a possible start of a stop string) are held back with it, so
        the tokens returned end at the one that completed a stop string, streamed or not."""
        outcome = "abort"
        held: list[int] = []  # tokens not yet returned, their text held back
        held_lps: list | None = None
        try:
            async for piece in self.handle:
                self._time(len(piece.tokens))
                text = piece.text or ""
                ids, lps = piece.tokens, piece.logprobs
                if self.stops:
                    text = self.stops.push(text)
                    ids = held + ids
                    lps = (held_lps or []) + lps if lps is not None else None
                    if self.stops.hit:  # keep the tokens up to the one that completed the stop string
                        k = max(self._tokens_to(self.stops.end, self.ids + ids) - len(self.ids), 0)
                        ids, lps = ids[:k], lps[:k] if lps is not None else None
                    elif not text:  # nothing released: hold these tokens back with their text
                        held, held_lps, ids, lps = ids, lps, [], None
                    if text or self.stops.hit:
                        held, held_lps = [], None
                self.ids += ids
                if text or ids:
                    yield text, ids, lps
                if self.stops and self.stops.hit:
                    self.handle.cancel()  # frees the row at the next iteration
                    break
            if self.stops and not self.stops.hit and ((tail := self.stops.flush()) or held):
                self.ids += held
                yield tail, held, held_lps
            reason = "eos" if self.stops and self.stops.hit else self.handle.stats.finish_reason
            # the engine's reasons in OpenAI's words ("abort" as vLLM: the engine closed under it)
            self.finish = {"eos": "stop", "length": "length"}.get(reason, "abort")
            outcome = self.finish
        except Exception:  # the engine failed this request (GeneratorExit / CancelledError are an abort)
            outcome = "error"
            raise
        finally:  # also when the client went away (the generator is closed or cancelled)
            if outcome in ("abort", "error"):
                self.handle.cancel()
            self._record(outcome)

    def _tokens_to(self, end: int, ids: list[int]) -> int:
        """How many of ``ids`` it takes for their decoded text to reach character ``end``: the
        token that completed a stop string is the last kept (bisection: decoded length grows
        with the prefix)."""
        codec = self.handle.codec
        if codec is None:
            return len(ids)
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(codec.decode(ids[:mid])) >= end:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _time(self, n: int) -> None:
        if not n:
            return
        now = clock()
        if self.last is None:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            for _ in range(n):  # an iteration's tokens arrive together: spread its gap over them
                self.metrics.itl.observe((now - self.last) / n)
        self.last = now

    def _record(self, outcome: str) -> None:
        m = self.metrics
        m.requests.labels(outcome).inc()
        m.prompt_tokens.inc(len(self.handle.request.input_ids))
        m.generation_tokens.inc(len(self.ids))
        m.latency.observe(clock() - self.arrival)


def echoed_prompt(body, handle: Handle) -> tuple[str, list]:
    """With ``echo``: the prompt's text and its (token, TokenLogprob or None) pairs (the first
    token has none; empty when logprobs were not asked); else ("", [])."""
    if not getattr(body, "echo", False):
        return "", []
    ids = handle.request.input_ids.tolist()
    text = handle.codec.decode(ids) if handle.codec else ""
    return text, list(zip(ids, handle.prompt_logprobs)) if handle.prompt_logprobs is not None else []


def spec_metrics(handles: list[Handle]) -> dict:
    """The request's speculative decoding over all its choices, as vLLM reports it per request
    (``metrics.speculative_decoding``, its --per-request-spec-decode-metrics summary), plus what
    only specdec has: the drafter, whether γ adapted, and the target calls (plain steps included).
    ``acceptance_histogram[j]``: verify calls that kept exactly j drafts (a chain keeps position
    i only after 1..i-1, so ``accepted_at[i-1]`` counts the calls that kept >= i)."""
    stats = [h.stats for h in handles]
    steps, drafted, accepted = (sum(getattr(s, k) for s in stats) for k in ("verify_calls", "drafted", "accepted"))
    width = max(len(s.accepted_at) for s in stats)
    at_least = [steps] + [sum(s.accepted_at[i] for s in stats if i < len(s.accepted_at)) for i in range(width)]  # calls that kept >= j
    return {
        "mean_acceptance_length": 1.0 + (accepted / steps if steps else 0.0),
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_histogram": [at_least[j] - (at_least[j + 1] if j < width else 0) for j in range(width + 1)],
        "num_spec_steps": steps,
        "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": drafted,
        "num_spec_tokens": stats[0].gamma,
        "drafter": stats[0].drafter,
        "adaptive_gamma": stats[0].adaptive,
        "target_calls": sum(s.target_calls for s in stats),
    }


def with_metrics(out: dict, handles: list[Handle], mode: str) -> dict:
    """``out`` with the request's ``metrics.speculative_decoding`` where the server reports them (``mode`` "summary")."""
    return {**out, "metrics": {"speculative_decoding": spec_metrics(handles)}} if mode == "summary" else out


def usage(gens: list[Generation], rows: int, kept: bool = True) -> dict:
    """Token counts of a request: each prompt once (its ``rows`` rows share it), every row's
    tokens (best_of's unreturned ones too, as OpenAI bills them; none when ``kept`` is False:
    max_tokens=0 drops the token decoded)."""
    p = sum(len(g.handle.request.input_ids) for g in gens[::rows])
    c = sum(len(g.ids) for g in gens) if kept else 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def best(scored: list[list], rows: int, n: int) -> list[int]:
    """Which rows to return: of each prompt's ``rows`` (consecutive), the ``n`` with the highest
    cumulative logprob of their tokens (``scored[i]``: row i's (token, TokenLogprob) pairs), in
    that order; all of them when rows == n."""
    if rows == n:
        return list(range(len(scored)))
    picked = []
    for start in range(0, len(scored), rows):
        group = range(start, start + rows)
        picked += sorted(group, key=lambda i: -sum(lp.logprob for _, lp in scored[i]))[:n]  # stable: ties keep row order
    return picked


async def sse(gens: list[Generation], kind, body, head: dict, codec: TextCodec | None, metrics: str = "none") -> AsyncIterator[str]:
    """Server-sent events: one chunk per accepted piece of a choice (its ``index`` named, with
    its tokens' logprobs when asked; with ``echo`` the first carries the prompt), a last one per
    choice with its finish_reason, a usage chunk when asked, then ``data: [DONE]``. With
    ``metrics`` "summary", the last chunk with a choice, and the usage chunk, carry
    ``metrics.speculative_decoding`` (``spec_metrics``)."""
    opts = body.stream_options
    every = bool(opts and opts.continuous_usage_stats)
    handles = [g.handle for g in gens]
    first = [True] * len(gens)
    offset = [0] * len(gens)  # characters of each choice's text streamed so far (logprobs' text_offset)
    keep = kind.max_tokens(body) != 0  # max_tokens=0 (with echo): the prompt alone

    def chunk(i: int, text: str, ids: list[int], finish: str | None, scored=None) -> dict:
        if first[i]:
            echo, echoed = echoed_prompt(body, handles[i])
            text, scored = echo + text, (echoed + (scored or [])) if handles[i].logprobs is not None else scored
        choice = kind.choice(i, text, finish, first[i], True, scored, codec, offset[i])
        offset[i] += len(text)
        if body.return_token_ids:
            choice["token_ids"] = ids or []
            if first[i] and len(gens) > body.choices:
                choice["prompt_token_ids"] = handles[i].request.input_ids.tolist()
        out = {**head, "choices": [choice]}
        if first[i] and i == 0 and body.return_token_ids and len(gens) == body.choices:
            out["prompt_token_ids"] = handles[0].request.input_ids.tolist()
        if every:
            out["usage"] = usage(gens, body.rows, keep)
        first[i] = False
        return out

    queue, tasks = pumps(gens, keep)
    try:
        left = len(gens)
        while left:
            i, text, ids, scored, error = await queue.get()
            if error is not None:  # tell the client in the stream, then end it
                log.error("stream %s failed: %s", head["id"], error)
                yield event({"error": {"message": f"decoding failed: {error}", "type": "server_error", "param": None, "code": None}})
                yield "data: [DONE]\n\n"
                return
            if text is not None:
                yield event(chunk(i, text, ids, None, scored))
                continue
            left -= 1
            last = chunk(i, "", [], gens[i].finish if keep else "length")
            yield event(with_metrics(last, handles, metrics) if not left else last)
    finally:  # a client that left (or an error) ends every choice: deltas' cleanup cancels them
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if opts and opts.include_usage:
        yield event(with_metrics({**head, "choices": [], "usage": usage(gens, body.rows, keep)}, handles, metrics))
    yield "data: [DONE]\n\n"


def pumps(gens: list[Generation], keep: bool) -> tuple[asyncio.Queue, list[asyncio.Future]]:
    """Every choice's pieces into one queue, (choice, text, ids, scored pairs, None) each (text
    None: that choice ended; an exception last: the engine failed it), and the tasks that read them."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: Generation) -> None:
        try:
            async for text, ids, lps in gen.deltas():
                if keep:
                    await queue.put((i, text, ids, list(zip(ids, lps)) if lps is not None else None, None))
            await queue.put((i, None, None, None, None))
        except Exception as e:  # the engine failed this choice
            await queue.put((i, None, None, None, e))

    return queue, [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]


def event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"

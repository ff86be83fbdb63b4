"""What the routes call: a body read and checked (``read``), its prompts tokenized off the event
loop, its constraint compiled, its choices admitted to the engine as one group (``admit``), and
the answer: one JSON body, SSE chunks, or a beam search's sequences (``generate``).

A failure before any token is a ``Refused`` (serve/errors.py), answered as an error body.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from specdec.errors import InputError, QueueFullError
from specdec.runtime.handles import Handle
from specdec.runtime.params import BeamParams, SamplingParams
from specdec.runtime.text import TextCodec
from specdec.serve.errors import RETRY_AFTER, Refused, check_json
from specdec.serve.generation import Generation, best, echoed_prompt, with_metrics, sse, usage
from specdec.serve.kinds import Chat
from specdec.serve.limits import loads
from specdec.serve.protocol import FieldError
from specdec.serve.validation import parse
from specdec.serve.state import ServerState
from specdec.serve.tools import plan, stream_chunks

log = logging.getLogger("specdec.serve")
clock = time.perf_counter
DISCONNECT_POLL = 0.1  # seconds between checks that a non-streamed request's client is still there


async def read(state: ServerState, request: Request, cls):
    """Check the key and the model, parse the body as ``cls``; a ``Refused`` says why not."""
    state.check_key(request)
    check_json(request)
    state.ready()
    try:
        body = parse(cls, loads(await request.body()))
    except (FieldError, InputError) as e:
        raise Refused(400, str(e), param=getattr(e, "param", None)) from None
    if body.model is not None and body.model != state.model:
        raise Refused(404, f"model {body.model!r} is not served here; this server serves {state.model!r}", param="model", code="model_not_found")
    return body


def needs_codec(state: ServerState, route: str) -> TextCodec:
    if state.codec is None:
        raise Refused(400, f"/{route}: the bundle has no tokenizer")
    return state.codec


async def generate(state: ServerState, request: Request, cls, kind):
    """/v1/completions and /v1/chat/completions (``kind``: Completions or Chat)."""
    arrival = clock()
    try:
        body = await read(state, request, cls)
        prompts = await tokenized(state, body, kind)
        if body.use_beam_search:
            return await beam_search(state, body, kind, prompts)
        await compile_grammar(state, body)
        handles = admit(state, body, kind, prompts, state.cache_salt(request, body.cache_salt))
    except Refused as e:
        if state.metrics:
            state.metrics.requests.labels(e.outcome).inc()
        return e.response()
    gens = [Generation(h, body.stops, arrival, state.metrics) for h in handles]
    rid, created = f"{kind.id_prefix}-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "object": kind.object, "created": created, "model": state.model, "system_fingerprint": state.fingerprint}
    tools = plan(body) if kind is Chat else None
    if body.stream and tools is None:
        return StreamingResponse(sse(gens, kind, body, {**head, "object": kind.chunk_object}, state.codec, state.spec_decode_metrics), media_type="text/event-stream")
    keep = kind.max_tokens(body) != 0  # max_tokens=0 (with echo): the prompt alone; the one token decoded is dropped
    got = await collected(request, gens, keep, rid)
    if isinstance(got, Response):
        return got
    out = whole(state, body, kind, gens, head, *got, keep)
    return out if tools is None else with_calls(out, body, tools)


async def collected(request: Request, gens: list[Generation], keep: bool, rid: str) -> tuple[list, list] | Response:
    """Every choice read to its end: (its text pieces, its (token, TokenLogprob) pairs) per choice;
    a Response instead when the client left (499) or the engine failed the request (500)."""
    text, scored = [[] for _ in gens], [[] for _ in gens]

    async def collect(i: int, gen: Generation):
        async for t, ids, lps in gen.deltas():
            if keep:
                text[i].append(t)
                scored[i].extend(zip(ids, lps) if lps is not None else ())

    task = asyncio.ensure_future(asyncio.gather(*(collect(i, g) for i, g in enumerate(gens))))
    try:
        while not task.done():  # a client that leaves cancels its request, as a stream's does
            await asyncio.wait({task}, timeout=DISCONNECT_POLL)
            if not task.done() and await request.is_disconnected():
                task.cancel()  # deltas' cleanup cancels the request in the engine
                await asyncio.gather(task, return_exceptions=True)
                return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        task.result()
    except Exception as e:  # the engine failed this request
        log.error("request %s failed: %s", rid, e)
        return Refused(500, f"decoding failed: {e}", "server_error").response()
    finally:
        task.cancel()  # a no-op once done; ends it if this handler is cancelled
    return text, scored


def whole(state: ServerState, body, kind, gens: list[Generation], head: dict, text: list, scored: list, keep: bool) -> dict:
    """The one JSON body of a request read to its end: the best choices, usage, the speculative figures where asked."""
    handles = [g.handle for g in gens]
    tokens = [g.ids if keep else [] for g in gens]
    scored = [s[: len(g.ids)] for s, g in zip(scored, gens)]  # a stop string may have taken back a token
    picked = best(scored, body.rows, body.choices)
    returns_logprobs = kind.logprobs(body)[0] is not None
    choices = []
    for index, i in enumerate(picked):
        g = gens[i]
        echo, echoed = echoed_prompt(body, g.handle)
        lps = (echoed + scored[i]) if returns_logprobs else None
        finish = g.finish if keep else "length"
        choices.append(kind.choice(index, echo + "".join(text[i]), finish, True, False, lps, state.codec))
    out = with_metrics({**head, "choices": choices, "usage": usage(gens, body.rows, keep)}, handles, state.spec_decode_metrics)
    if body.return_token_ids:
        for choice, i in zip(choices, picked):
            choice["token_ids"] = tokens[i]
            if len(handles) > body.rows:  # several prompts: each choice names its own
                choice["prompt_token_ids"] = handles[i].request.input_ids.tolist()
        if len(handles) == body.rows:
            out["prompt_token_ids"] = handles[0].request.input_ids.tolist()
    return out


def with_calls(out: dict, body, tools):
    """A tool request's answer: each message as its tool calls; streamed whole when asked (the
    calls are known when the output ends)."""
    for choice in out["choices"]:
        choice["message"], choice["finish_reason"] = tools.message(choice["message"]["content"], choice["finish_reason"])
    if body.stream:
        opts = body.stream_options
        events = [f"data: {json.dumps(c)}\n\n" for c in stream_chunks(out, bool(opts and opts.include_usage))] + ["data: [DONE]\n\n"]
        return StreamingResponse(iter(events), media_type="text/event-stream")
    return out


async def tokenized(state: ServerState, body, kind) -> list[list[int]]:
    """The request's prompts as ids, tokenized on a worker thread (a long prompt takes a
    second; the event loop keeps serving meanwhile); a bad one is a 400."""
    try:
        return await asyncio.to_thread(kind.prompts, state, body)
    except (FieldError, ValueError) as e:
        raise Refused(400, str(e), param=getattr(e, "param", None)) from None


async def beam_search(state: ServerState, body, kind, prompts: list[list[int]]):
    """Each prompt's beam search (width best_of, else n; the best n returned), on a worker
    thread beside the engine's rows (runtime/beam_search.py: one search at a time)."""
    engine = state.ready()
    width = getattr(body, "best_of", None) or body.choices
    choices, p_tokens, c_tokens = [], 0, 0
    try:
        for i, prompt in enumerate(prompts):
            max_tokens = kind.max_tokens(body) or max(1, state.max_seq_len - len(prompt))
            params = BeamParams(num_beams=width, max_new_tokens=max_tokens, length_penalty=1.0 if body.length_penalty is None else body.length_penalty,
                                early_stopping=body.early_stopping or False, num_return_sequences=body.choices, ignore_eos=body.ignore_eos,
                                stop_token_ids=tuple(body.stop_token_ids or ()))  # plain: the speculative one pays only on memory-bound targets  # fmt: skip
            res = await asyncio.to_thread(engine.beam_search, prompt, params)
            p_tokens += len(prompt)
            stop = set(body.stop_token_ids or ()) | (set() if body.ignore_eos else set(state.manifest.eos_token_ids))
            for j, b in enumerate(res.sequences):
                finish = "stop" if b.tokens and b.tokens[-1] in stop else "length"
                choice = kind.choice(i * body.choices + j, b.text if b.text is not None else "", finish, True, False)
                if body.return_token_ids:
                    choice["token_ids"] = b.tokens
                choices.append(choice)
                c_tokens += len(b.tokens)
    except (FieldError, ValueError) as e:
        raise Refused(400, str(e), param=getattr(e, "param", None)) from None
    if state.metrics:
        state.metrics.requests.labels(choices[0]["finish_reason"]).inc()
        state.metrics.prompt_tokens.inc(p_tokens)
        state.metrics.generation_tokens.inc(c_tokens)
    head = {"id": f"{kind.id_prefix}-{uuid.uuid4().hex}", "object": kind.object, "created": int(time.time()), "model": state.model,
            "system_fingerprint": state.fingerprint}  # fmt: skip
    return {**head, "choices": choices, "usage": {"prompt_tokens": p_tokens, "completion_tokens": c_tokens, "total_tokens": p_tokens + c_tokens}}


async def compile_grammar(state: ServerState, body) -> None:
    """Compile the request's constraint off the event loop (a large schema takes up to a
    second; the engine's cache then holds it for ``admit``); a bad one is a 400."""
    spec = body.structured()
    if spec is None:
        return
    engine = state.ready()
    field = body.constraint_field()
    if state.codec is None:
        raise Refused(400, "structured outputs need the bundle's tokenizer, which this bundle lacks", param=field)
    try:
        await asyncio.to_thread(lambda: state.codec.grammars(engine.limits).compile(spec))
    except ValueError as e:  # specdec's InputError and ConfigError are ValueErrors
        raise Refused(400, str(e), param=field) from None


def admit(state: ServerState, body, kind, prompts: list[list[int]], salt: str | None = None) -> list[Handle]:
    """Submit a parsed request (``read``), one handle per choice (prompt i's choice j at
    i * n + j, its seed + j when seeded), queued as one group under the cache ``salt``
    (``ServerState.cache_salt``); a ``Refused`` says why not, and then none is queued."""
    engine = state.ready()
    group: list[tuple[list[int], SamplingParams]] = []
    try:
        for prompt in prompts:
            max_tokens = kind.max_tokens(body)
            if max_tokens is None:  # as much as fits
                max_tokens = max(1, state.max_seq_len - len(prompt))
            max_tokens = max_tokens or 1  # max_tokens=0 with echo: one token decoded and dropped
            logprobs, prompt_logprobs = kind.logprobs(body)
            if logprobs is None and body.rows > body.choices:
                logprobs = 0  # best_of ranks by them (not returned: the handle keeps them, the choice does not ask)
            sampling = {**body.sampling(), "logprobs": logprobs, "prompt_logprobs": prompt_logprobs, "logprobs_mode": state.logprobs_mode, "cache_salt": salt}
            gamma = state.request_gamma(sampling)
            for j in range(body.rows):
                seed = None if sampling["seed"] is None else sampling["seed"] + j
                group.append((prompt, SamplingParams(max_new_tokens=max_tokens, gamma=gamma, **{**sampling, "seed": seed})))
        return engine.submit_together(group)  # checked whole, queued whole: the choices of a prompt feed it once
    except Exception as e:
        if isinstance(e, QueueFullError):
            raise Refused(503, str(e), "server_error", code="queue_full", outcome="rejected", headers={"Retry-After": RETRY_AFTER}) from None
        if isinstance(e, (FieldError, ValueError)):  # every specdec input error is a ValueError
            raise Refused(400, str(e), param=getattr(e, "param", None)) from None
        raise

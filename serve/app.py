"""The OpenAI-compatible HTTP application over one ``BatchEngine``.

    POST /v1/completions, /v1/chat/completions ─► parse (protocol) ─► token ids per prompt
        ─► engine.submit per choice (prompts x n) ─► Handle pieces (async) ─► stop strings (stops)
        ─► one JSON body, or SSE chunks (each naming its choice's index) + [DONE]
    POST /tokenize, /detokenize, GET /tokenizer_info (vLLM's shapes)
    GET /v1/models, /health, /metrics, /version

Every failure is an OpenAI-style error body ``{"error": {"message", "type", "param", "code"}}``:
400 for bad input, 401 without the API key, 404 for an unknown model or route, 413 for a body
over ``MAX_BODY`` (serve/limits.py), 415 for a POST whose body is not ``application/json``
(a web page can send text/plain or a form to localhost without a CORS preflight), 503 while
loading or when the queue is full (with Retry-After), 500 only for a server-side failure (no
traceback). CORS is off unless ``allowed_origins`` names origins.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from specdec import __version__
from specdec.errors import InputError, QueueFullError
from specdec.runtime.handles import Handle
from specdec.runtime.params import BeamParams, SamplingParams
from specdec.runtime.text import TextCodec
from specdec.serve.chat import ChatTemplate
from specdec.serve.limits import MAX_BODY, BodyLimit, loads
from specdec.serve.metrics import Metrics
from specdec.serve.tools import plan, stream_chunks, template_messages, with_tools
from specdec.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, FieldError, TokenizeRequest, parse, prompts_of
from specdec.serve.stops import StopStrings

log = logging.getLogger("specdec.serve")
clock = time.perf_counter
RETRY_AFTER = "1"  # seconds a refused client should wait (a row frees every few iterations)
DISCONNECT_POLL = 0.1  # seconds between checks that a non-streamed request's client is still there


class Refused(Exception):
    """A request answered with an error body: HTTP status, OpenAI error type and code."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, outcome: str = "invalid", headers: dict | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.outcome, self.headers = outcome, headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


@dataclass
class ServerState:
    """What the routes share. ``engine`` is None until the bundle is loaded and warmed."""

    model: str  # the served model name
    max_seq_len: int
    codec: TextCodec | None
    chat: ChatTemplate | None
    gamma: int | str | None  # each request's γ: an int, "auto", or None for the bundle's
    api_key: str | None = None
    engine: Any = None  # BatchEngine once ready
    manifest: Any = None  # the bundle's Manifest, opened and verified once
    metrics: Metrics | None = None
    failed: str | None = None  # why loading failed
    fingerprint: str | None = None  # OpenAI's system_fingerprint: which server (or Ray replica) answered
    logprobs_mode: str = "raw"  # "raw" or "processed" (vLLM's --logprobs-mode raw_logprobs / processed_logprobs)
    allowed_origins: tuple[str, ...] = ()  # CORS origins; none: no CORS headers
    created: int = field(default_factory=lambda: int(time.time()))

    def ready(self):
        if self.engine is None:
            why = f"the model failed to load: {self.failed}" if self.failed else "the model is still loading"
            raise Refused(503, f"{why}; retry later", "server_error", code="not_ready", outcome="rejected", headers={"Retry-After": RETRY_AFTER})
        return self.engine

    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise Refused(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'", code="invalid_api_key")


def check_json(request: Request) -> None:
    """415 unless the body is declared ``application/json`` (any charset parameter)."""
    kind = request.headers.get("content-type", "")
    if kind.split(";")[0].strip().lower() != "application/json":
        raise Refused(415, f"Content-Type {kind or '(none)'!r}: expected 'application/json'; send the body as JSON with that header",
                      code="unsupported_media_type")  # fmt: skip


def finite(v: float) -> float:
    """A logprob as JSON can carry it: a token the settings exclude (-inf) as vLLM writes it, -9999.0."""
    return v if v > -9999.0 else -9999.0


def encode(state: ServerState, text: str, special: bool, param: str) -> list[int]:
    """A prompt's ids; text too long to fit in the context whatever it says is refused before
    the tokenizer reads it (runtime/text.py ``max_chars``)."""
    limit = state.codec.max_chars(state.max_seq_len)
    if len(text) > limit:
        raise FieldError(f"{param}: {len(text)} characters; with this tokenizer no text over {limit} characters fits in the "
                         f"{state.max_seq_len} tokens of the context (max_model_len); shorten it", param)  # fmt: skip
    return state.codec.encode(text, special)


# -- the two endpoints' differences --------------------------------------------------------------


class Completions:
    object, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl"

    @staticmethod
    def prompts(state: ServerState, body: CompletionRequest) -> list[list[int]]:
        out = []
        for prompt in prompts_of(body):
            if isinstance(prompt, list):
                out.append(prompt)  # the engine checks the ids against the vocabulary
            elif state.codec is None:
                raise FieldError("prompt is text but the bundle has no tokenizer; send token ids", "prompt")
            else:
                out.append(encode(state, prompt, True, "prompt"))
        return out

    @staticmethod
    def max_tokens(body: CompletionRequest) -> int | None:
        return body.max_tokens

    @staticmethod
    def logprobs(body: CompletionRequest) -> tuple[int | None, int | None]:
        """(alternatives per generated token, per prompt token): None when not asked."""
        return body.logprobs, body.logprobs if body.echo and body.logprobs is not None else None

    @staticmethod
    def choice(index: int, text: str, finish: str | None, first: bool, stream: bool, scored=None, codec=None, offset: int = 0) -> dict:
        """``scored``: (position, TokenLogprob or None) pairs of this piece, as OpenAI's legacy
        logprobs object (tokens, token_logprobs, top_logprobs, text_offset from ``offset``)."""
        logprobs = None
        if scored is not None:
            words = [word(codec, tok) for tok, _ in scored]
            offsets = list(itertools.accumulate((len(w) for w in words[:-1]), initial=offset)) if words else []
            logprobs = {"tokens": words, "token_logprobs": [finite(lp.logprob) if lp else None for _, lp in scored],
                        "top_logprobs": [{word(codec, t): finite(v) for t, v in lp.top} if lp else None for _, lp in scored],
                        "text_offset": offsets}  # fmt: skip
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


class Chat:
    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    @staticmethod
    def prompts(state: ServerState, body: ChatCompletionRequest) -> list[list[int]]:
        if state.chat is None:
            raise FieldError("messages: this bundle has no chat template; start the server with --chat-template FILE, or use /v1/completions", "messages")
        if state.codec is None:
            raise FieldError("messages: the bundle has no tokenizer to encode a chat; use /v1/completions with token ids", "messages")
        tools = plan(body)
        extra = {**(body.chat_template_kwargs or {}), **({"tools": list(tools.tools)} if tools else {})}
        messages = template_messages(body.messages)
        if tools is not None and tools.mode == "auto":  # required and named calls are held to their schemas anyway
            messages = with_tools(messages, tools, state.chat.source)
        text = state.chat.render(messages, body.add_generation_prompt, **extra)
        return [encode(state, text, False, "messages")]  # the template wrote the special tokens

    @staticmethod
    def max_tokens(body: ChatCompletionRequest) -> int | None:
        return body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens

    @staticmethod
    def logprobs(body: ChatCompletionRequest) -> tuple[int | None, int | None]:
        return (body.top_logprobs or 0) if body.logprobs else None, None

    @staticmethod
    def choice(index: int, text: str, finish: str | None, first: bool, stream: bool, scored=None, codec=None, offset: int = 0) -> dict:
        """``scored``: (token, TokenLogprob) pairs as the chat logprobs object ({"content": [...]})."""

        def entry(t: int, v: float) -> dict:
            w = word(codec, t)
            return {"token": w, "logprob": finite(v), "bytes": list(w.encode())}

        logprobs = None
        if scored is not None:
            logprobs = {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for _, lp in scored],
                        "refusal": None}  # fmt: skip
        if not stream:
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs, "finish_reason": finish}
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text or finish is None else {})
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


# -- one request's output ----------------------------------------------------------------------


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


def word(codec: TextCodec | None, token: int) -> str:
    """One token as text (vLLM's "token_id:N" without a tokenizer)."""
    return codec.decode([token]) if codec is not None else f"token_id:{token}"


def echoed_prompt(body, handle: Handle) -> tuple[str, list]:
    """With ``echo``: the prompt's text and its (token, TokenLogprob or None) pairs (the first
    token has none; empty when logprobs were not asked); else ("", [])."""
    if not getattr(body, "echo", False):
        return "", []
    ids = handle.request.input_ids.tolist()
    text = handle.codec.decode(ids) if handle.codec else ""
    return text, list(zip(ids, handle.prompt_logprobs)) if handle.prompt_logprobs is not None else []


def speculative(handles: list[Handle]) -> dict:
    """The request's speculative-decoding figures over all its choices (the response's
    ``speculative`` extension)."""
    stats = [h.stats for h in handles]
    first = stats[0]
    calls, drafted, accepted = (sum(getattr(s, k) for s in stats) for k in ("target_calls", "drafted", "accepted"))
    verify = sum(s.verify_calls for s in stats)
    return {
        "drafter": first.drafter,
        "gamma": first.gamma,
        "adaptive_gamma": first.adaptive,
        "target_calls": calls,
        "verify_calls": verify,
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": first.acceptance_rate if len(stats) == 1 else (accepted / drafted if drafted else 0.0),
        "mean_accepted_tokens": first.mean_accepted if len(stats) == 1 else (accepted / verify if verify else 0.0),
    }


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


# -- the application ---------------------------------------------------------------------------


def build_app(state: ServerState, lifespan=None) -> FastAPI:
    """The routes over ``state``; ``lifespan`` loads the engine (see ``server.serve``)."""
    app = FastAPI(title="specdec", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.specdec = state
    # /tokenize's text, up to the body limit (8 MiB: ~14 s of a core), is encoded on its own
    # thread: prompts of generation requests (to_thread's pool) never queue behind it
    bulk = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-tokenize")
    app.add_middleware(BodyLimit, max_body=MAX_BODY)  # 413 while reading, past MAX_BODY (serve/limits.py)
    if state.allowed_origins:  # opt-in, as vLLM's and llama-server's
        app.add_middleware(CORSMiddleware, allow_origins=list(state.allowed_origins), allow_methods=["*"], allow_headers=["*"])

    @app.exception_handler(Refused)
    async def _refused(request: Request, e: Refused):
        return e.response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException):
        message = f"{request.method} {request.url.path}: {e.detail}"
        return Refused(e.status_code, message, code="not_found" if e.status_code == 404 else None).response()

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception):
        log.exception("request failed")
        return Refused(500, f"internal error ({type(e).__name__}); the server log has the details", "server_error").response()

    @app.get("/health")
    async def health():
        if state.engine is None:
            return JSONResponse({"status": "failed" if state.failed else "loading", "reason": state.failed}, status_code=503, headers={"Retry-After": RETRY_AFTER})
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models(request: Request):
        state.check_key(request)
        card = {"id": state.model, "object": "model", "created": state.created, "owned_by": "specdec", "max_model_len": state.max_seq_len}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics(request: Request):
        state.check_key(request)
        state.ready()
        return Response(state.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read(request, TokenizeRequest)
        codec = needs_codec("tokenize")
        if body.messages is not None:
            try:
                ids = (await asyncio.to_thread(Chat.prompts, state, body))[0]  # as a chat request's prompt becomes
            except FieldError as e:
                raise Refused(400, str(e), param=e.param) from None
        else:  # any length the body limit lets in: lm-eval counts whole documents past the context (rolling windows)
            loop = asyncio.get_running_loop()
            ids = await loop.run_in_executor(bulk, codec.encode, body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": state.max_seq_len, "tokens": ids}

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        """vLLM's: the tokenizer's special tokens and chat template, what a client that
        tokenizes through the server reads (lm-evaluation-harness's remote tokenizer)."""
        state.check_key(request)
        codec, m = needs_codec("tokenizer_info"), state.ready() and state.manifest
        name = lambda i: codec.tokenizer.id_to_token(i) if i is not None else None  # noqa: E731
        return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(m.bos_token_id),
                "eos_token": name(m.eos_token_ids[0] if m.eos_token_ids else None), "pad_token": name(m.pad_token_id),
                "model_max_length": state.max_seq_len, "chat_template": state.chat.source if state.chat else None}  # fmt: skip

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read(request, DetokenizeRequest)
        codec = needs_codec("detokenize")
        bad = [t for t in body.tokens if not 0 <= t < state.manifest.vocab_size] if state.manifest else []
        if bad:
            raise Refused(400, f"tokens: ids {bad[:5]} are outside the vocabulary [0, {state.manifest.vocab_size})", param="tokens")
        return {"prompt": codec.decode(body.tokens)}

    async def read(request: Request, cls):
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

    def needs_codec(route: str) -> TextCodec:
        if state.codec is None:
            raise Refused(400, f"/{route}: the bundle has no tokenizer")
        return state.codec

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, CompletionRequest, Completions)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate(request, ChatCompletionRequest, Chat)

    async def generate(request: Request, cls, kind):
        arrival = clock()
        try:
            body = await read(request, cls)
            prompts = await tokenized(body, kind)
            if body.use_beam_search:
                return await beam_search(body, kind, prompts)
            await compile_grammar(body)
            handles = admit(body, kind, prompts)
        except Refused as e:
            if state.metrics:
                state.metrics.requests.labels(e.outcome).inc()
            return e.response()
        gens = [Generation(h, body.stops, arrival, state.metrics) for h in handles]
        rid, created = f"{kind.id_prefix}-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": kind.object, "created": created, "model": state.model, "system_fingerprint": state.fingerprint}
        tools = plan(body) if kind is Chat else None
        if body.stream and tools is None:
            return StreamingResponse(sse(gens, kind, body, {**head, "object": kind.chunk_object}, state.codec), media_type="text/event-stream")
        text, tokens, scored = [[] for _ in gens], [[] for _ in gens], [[] for _ in gens]
        keep = kind.max_tokens(body) != 0  # max_tokens=0 (with echo): the prompt alone; the one token decoded is dropped

        async def collect(i: int, gen: Generation):
            async for t, ids, lps in gen.deltas():
                if keep:
                    text[i].append(t)
                    tokens[i].extend(ids)
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
        for i, g in enumerate(gens):
            tokens[i], scored[i] = g.ids if keep else [], scored[i][: len(g.ids)]  # a stop string may have taken back a token
        picked = best(scored, body.rows, body.choices)
        returns_logprobs = kind.logprobs(body)[0] is not None
        choices = []
        for index, i in enumerate(picked):
            g = gens[i]
            echo, echoed = echoed_prompt(body, g.handle)
            lps = (echoed + scored[i]) if returns_logprobs else None
            finish = g.finish if keep else "length"
            choices.append(kind.choice(index, echo + "".join(text[i]), finish, True, False, lps, state.codec))
        out = {**head, "choices": choices, "usage": usage(gens, body.rows, keep), "speculative": speculative(handles)}
        if body.return_token_ids:
            for choice, i in zip(choices, picked):
                choice["token_ids"] = tokens[i]
                if len(handles) > body.rows:  # several prompts: each choice names its own
                    choice["prompt_token_ids"] = handles[i].request.input_ids.tolist()
            if len(handles) == body.rows:
                out["prompt_token_ids"] = handles[0].request.input_ids.tolist()
        if tools is not None:
            for choice in choices:
                choice["message"], choice["finish_reason"] = tools.message(choice["message"]["content"], choice["finish_reason"])
            if body.stream:  # a tool request streams its finished message: calls are known when the output ends
                opts = body.stream_options
                events = [f"data: {json.dumps(c)}\n\n" for c in stream_chunks(out, bool(opts and opts.include_usage))] + ["data: [DONE]\n\n"]
                return StreamingResponse(iter(events), media_type="text/event-stream")
        return out

    async def tokenized(body, kind) -> list[list[int]]:
        """The request's prompts as ids, tokenized on a worker thread (a long prompt takes a
        second; the event loop keeps serving meanwhile); a bad one is a 400."""
        try:
            return await asyncio.to_thread(kind.prompts, state, body)
        except (FieldError, ValueError) as e:
            raise Refused(400, str(e), param=getattr(e, "param", None)) from None

    async def beam_search(body, kind, prompts: list[list[int]]):
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

    async def compile_grammar(body) -> None:
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
            await asyncio.to_thread(lambda: state.codec.grammars(engine.limits).matcher(spec))
        except ValueError as e:  # specdec's InputError and ConfigError are ValueErrors
            raise Refused(400, str(e), param=field) from None

    def admit(body, kind, prompts: list[list[int]]) -> list[Handle]:
        """Submit a parsed request (``read``), one handle per choice (prompt i's choice j at
        i * n + j, its seed + j when seeded), queued as one group; a ``Refused`` says why not,
        and then none is queued."""
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
                sampling = {**body.sampling(), "logprobs": logprobs, "prompt_logprobs": prompt_logprobs, "logprobs_mode": state.logprobs_mode}
                for j in range(body.rows):
                    seed = None if sampling["seed"] is None else sampling["seed"] + j
                    group.append((prompt, SamplingParams(max_new_tokens=max_tokens, gamma=state.gamma, **{**sampling, "seed": seed})))
            return engine.submit_together(group)  # checked whole, queued whole: the choices of a prompt feed it once
        except Exception as e:
            if isinstance(e, QueueFullError):
                raise Refused(503, str(e), "server_error", code="queue_full", outcome="rejected", headers={"Retry-After": RETRY_AFTER}) from None
            if isinstance(e, (FieldError, ValueError)):  # every specdec input error is a ValueError
                raise Refused(400, str(e), param=getattr(e, "param", None)) from None
            raise

    return app


async def sse(gens: list[Generation], kind, body, head: dict, codec: TextCodec | None) -> AsyncIterator[str]:
    """Server-sent events: one chunk per accepted piece of a choice (its ``index`` named, with
    its tokens' logprobs when asked; with ``echo`` the first carries the prompt), a last one per
    choice with its finish_reason, a usage chunk when asked, then ``data: [DONE]``. The last
    chunk of a request with one choice carries the ``speculative`` figures."""
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

    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: Generation) -> None:
        try:
            async for text, ids, lps in gen.deltas():
                if keep:
                    await queue.put((i, text, ids, list(zip(ids, lps)) if lps is not None else None, None))
            await queue.put((i, None, None, None, None))
        except Exception as e:  # the engine failed this choice
            await queue.put((i, None, None, None, e))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
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
            yield event({**last, "speculative": speculative(handles)} if len(gens) == 1 else last)
    finally:  # a client that left (or an error) ends every choice: deltas' cleanup cancels them
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if opts and opts.include_usage:
        yield event({**head, "choices": [], "usage": usage(gens, body.rows, keep), "speculative": speculative(handles)})
    yield "data: [DONE]\n\n"


def event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"

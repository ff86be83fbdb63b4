"""The OpenAI-compatible HTTP application over one ``BatchEngine``.

    POST /v1/completions, /v1/chat/completions ─► parse (validation) ─► token ids per prompt
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

Here: the shared state and the routes. What they call: serve/completions.py (reading, admitting,
answering a generation request), serve/kinds.py (the two endpoints' differences),
serve/generation.py (one request's output, whole or as SSE), serve/errors.py (error bodies).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from specdec import __version__
from specdec.serve import errors
from specdec.serve.completions import generate, needs_codec, read
from specdec.serve.errors import RETRY_AFTER, Refused
from specdec.serve.kinds import Chat, Completions
from specdec.serve.limits import MAX_BODY, BodyLimit
from specdec.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, FieldError, TokenizeRequest
from specdec.serve.state import ServerState  # re-exported: serve/server.py and ray_app.py build it



def build_app(state: ServerState, lifespan=None) -> FastAPI:
    """The routes over ``state``; ``lifespan`` loads the engine (see ``server.serve``)."""
    app = FastAPI(title="specdec", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.specdec = state
    app.add_middleware(BodyLimit, max_body=MAX_BODY)  # 413 while reading, past MAX_BODY (serve/limits.py)
    if state.allowed_origins:  # opt-in, as vLLM's and llama-server's
        app.add_middleware(CORSMiddleware, allow_origins=list(state.allowed_origins), allow_methods=["*"], allow_headers=["*"])
    errors.install(app)
    info_routes(app, state)
    token_routes(app, state)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(state, request, CompletionRequest, Completions)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate(state, request, ChatCompletionRequest, Chat)

    return app


def info_routes(app: FastAPI, state: ServerState) -> None:
    """/health, /version, /v1/models, /metrics."""

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


def token_routes(app: FastAPI, state: ServerState) -> None:
    """vLLM's /tokenize, /detokenize and /tokenizer_info."""
    # /tokenize's text, up to the body limit (8 MiB: ~14 s of a core), is encoded on its own
    # thread: prompts of generation requests (to_thread's pool) never queue behind it
    bulk = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-tokenize")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read(state, request, TokenizeRequest)
        codec = needs_codec(state, "tokenize")
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
        codec, m = needs_codec(state, "tokenizer_info"), state.ready() and state.manifest
        name = lambda i: codec.tokenizer.id_to_token(i) if i is not None else None  # noqa: E731
        return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(m.bos_token_id),
                "eos_token": name(m.eos_token_ids[0] if m.eos_token_ids else None), "pad_token": name(m.pad_token_id),
                "model_max_length": state.max_seq_len, "chat_template": state.chat.source if state.chat else None}  # fmt: skip

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read(state, request, DetokenizeRequest)
        codec = needs_codec(state, "detokenize")
        bad = [t for t in body.tokens if not 0 <= t < state.manifest.vocab_size] if state.manifest else []
        if bad:
            raise Refused(400, f"tokens: ids {bad[:5]} are outside the vocabulary [0, {state.manifest.vocab_size})", param="tokens")
        return {"prompt": codec.decode(body.tokens)}

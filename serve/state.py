"""What the routes share: the served model, its codec and chat template, the engine once loaded."""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from specdec.runtime.engine import TENANT
from specdec.runtime.text import TextCodec
from specdec.serve.chat import ChatTemplate
from specdec.serve.errors import RETRY_AFTER, Refused
from specdec.serve.metrics import Metrics


@dataclass
class ServerState:
    """What the routes share. ``engine`` is None until the bundle is loaded and warmed."""

    model: str  # the served model name
    max_seq_len: int
    codec: TextCodec | None
    chat: ChatTemplate | None
    gamma: int | str | None  # each request's γ: an int, "auto", or None for the bundle's
    api_keys: tuple[str, ...] = ()  # any of them is let in; none: no key asked
    isolate_tenants: bool = False  # each key's requests get their own cache salt (cache_salt)
    spec_decode_metrics: str = "none"  # vLLM's --per-request-spec-decode-metrics: "summary" adds metrics.speculative_decoding
    engine: Any = None  # BatchEngine once ready
    manifest: Any = None  # the bundle's Manifest, opened and verified once
    metrics: Metrics | None = None
    failed: str | None = None  # why loading failed
    fingerprint: str | None = None  # OpenAI's system_fingerprint: which server (or Ray replica) answered
    logprobs_mode: str = "raw"  # "raw" or "processed" (vLLM's --logprobs-mode raw_logprobs / processed_logprobs)
    allowed_origins: tuple[str, ...] = ()  # CORS origins; none: no CORS headers
    created: int = field(default_factory=lambda: int(time.time()))

    def request_gamma(self, sampling: dict) -> int | str | None:
        """A request's γ: the server's, except that a seeded sampled request under ``auto`` keeps
        the bundle's fixed γ. Its tokens then reproduce run after run, as a seed promises; with γ
        chosen from timings they would follow the target's law but not repeat (greedy repeats either way)."""
        if self.gamma == "auto" and sampling.get("seed") is not None and sampling.get("temperature", 1.0) > 0:
            return None
        return self.gamma

    def ready(self):
        if self.engine is None:
            why = f"the model failed to load: {self.failed}" if self.failed else "the model is still loading"
            raise Refused(503, f"{why}; retry later", "server_error", code="not_ready", outcome="rejected", headers={"Retry-After": RETRY_AFTER})
        return self.engine

    def check_key(self, request: Request) -> None:
        """Let the request in when it carries one of the keys (each compared in constant time);
        its tenant, a digest of the key, goes on ``request.state.tenant``."""
        if not self.api_keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode()
        matched = [k for k in self.api_keys if hmac.compare_digest(given, k.encode())]
        if scheme.lower() != "bearer" or not matched:
            raise Refused(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'", code="invalid_api_key")
        request.state.tenant = hashlib.sha256(matched[0].encode()).hexdigest()[:32]

    def cache_salt(self, request: Request, asked: str | None) -> str | None:
        """The salt a request's prefix reuse runs under: with ``isolate_tenants``, its key's
        tenant's (the client's ``cache_salt`` only divides that further), else the client's own."""
        if self.isolate_tenants:
            own = f"{TENANT}{request.state.tenant}"
            return own if asked is None else f"{own}/{asked}"
        return None if asked is None else f"request:{asked}"

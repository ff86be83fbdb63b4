"""Limits on a request body, enforced while it is read and before it is parsed.

    bytes ──► BodyLimit (ASGI middleware) ──► route reads the body ──► loads(): UTF-8, JSON, depth ──► protocol

``BodyLimit`` counts the bytes of each ``http.request`` message as it arrives and answers 413 as
soon as the count passes ``MAX_BODY`` (chunked bodies included), or at once when a
Content-Length says more; the connection is closed, so the rest of the body is never read and
the server holds at most one transport buffer of it (uvicorn pauses reading at ~64 KiB).
``loads`` refuses a body nested deeper than ``MAX_DEPTH``: CPython's JSON parser raises
RecursionError past ~1,000 levels, and a walk over the decoded containers (one pass per level,
skipped when the body has too few brackets to nest that deep) catches the levels in between.
The bounds on list fields (``stop``, ``messages``, ...) live with the wire format in protocol.py.
"""

from __future__ import annotations

import json
import re
from typing import Any

from specdec.errors import InputError

MAX_BODY = 8 << 20  # bytes of a request body; a prompt of the longest context is far smaller
MAX_DEPTH = 64  # nesting of arrays and objects; a valid request needs 5 (messages, parts, kwargs)
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")  # an escaped UTF-16 surrogate: paired, or not


def error_body(message: str, code: str | None = None, type_: str = "invalid_request_error") -> bytes:
    """An OpenAI-style error body."""
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()


def error_messages(status: int, message: str, code: str | None, headers: list[tuple[bytes, bytes]] = ()) -> list[dict]:
    """The ASGI messages of an OpenAI-style error response (a server error from 500 up)."""
    body = error_body(message, code, "server_error" if status >= 500 else "invalid_request_error")
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    return [{"type": "http.response.start", "status": status, "headers": head}, {"type": "http.response.body", "body": body}]


def depth(value: Any) -> int:
    """How deep arrays and objects nest in ``value`` (decoded JSON), counted up to MAX_DEPTH + 1."""
    level, frontier = 0, [value] if isinstance(value, (list, dict)) else []
    while frontier and level <= MAX_DEPTH:  # one pass per level over the containers of that level
        level += 1
        frontier = [v for c in frontier for v in (c.values() if isinstance(c, dict) else c) if isinstance(v, (list, dict))]
    return level


def loads(data: bytes) -> Any:
    """A request body as JSON; an ``InputError`` for invalid UTF-8, invalid JSON, nesting over
    ``MAX_DEPTH`` or a lone surrogate."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"request body is not UTF-8 ({e})") from None
    too_deep = f"request body nests arrays and objects too deep; the limit is {MAX_DEPTH} levels"
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"request body is not valid JSON ({e})") from None
    except RecursionError:  # CPython's parser stops at ~1,000 levels (it counts them; no stack overflow)
        raise InputError(too_deep) from None
    if data.count(b"[") + data.count(b"{") > MAX_DEPTH and depth(raw) > MAX_DEPTH:  # fewer brackets: no need to look
        raise InputError(too_deep)
    if _SURROGATE.search(data):  # "\\ud800" is valid JSON but no Unicode text: tokenizers refuse it
        try:
            json.dumps(raw, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise InputError(f"request body has a lone UTF-16 surrogate escape ({e.object[e.start:e.end]!a}); send valid Unicode") from None
    return raw


class _TooLarge(Exception):
    """Raised into the app by ``BodyLimit``'s receive when the body passes the limit."""


class BodyLimit:
    """Pure ASGI middleware: 413 once a request body passes ``max_body`` bytes, read no further.

    Args:
        app: the ASGI application it wraps.
        max_body: the most bytes a body may have.
    """

    def __init__(self, app, max_body: int = MAX_BODY):
        self.app, self.max_body = app, max_body

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            return await self._refuse(send, int(declared))
        seen = 0
        started = False

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise _TooLarge
            return message

        async def watched(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except _TooLarge:
            if started:  # cannot answer any more: the server closes the connection
                raise
            await self._refuse(send, None)

    async def _refuse(self, send, declared: int | None) -> None:
        size = f"is {declared} bytes" if declared is not None else f"passed {self.max_body} bytes"
        message = f"request body {size}; the limit is {self.max_body} bytes: send a shorter prompt"
        for m in error_messages(413, message, "request_too_large", [(b"connection", b"close")]):
            await send(m)

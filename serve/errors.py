"""How the server refuses: an OpenAI-style error body ``{"error": {"message", "type", "param",
"code"}}`` with its HTTP status, and the handlers that turn every failure of a route into one
(a ``Refused``, Starlette's 404 and 405, anything else a 500 without a traceback).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger("specdec.serve")
RETRY_AFTER = "1"  # seconds a refused client should wait (a row frees every few iterations)


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


def check_json(request: Request) -> None:
    """415 unless the body is declared ``application/json`` (any charset parameter)."""
    kind = request.headers.get("content-type", "")
    if kind.split(";")[0].strip().lower() != "application/json":
        raise Refused(415, f"Content-Type {kind or '(none)'!r}: expected 'application/json'; send the body as JSON with that header",
                      code="unsupported_media_type")  # fmt: skip


def install(app: FastAPI) -> None:
    """Every failure of ``app``'s routes as an error body."""

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

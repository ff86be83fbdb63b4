"""HTTP requests relayed from a Ray Serve front deployment to the model replicas, so that a
replica that dies never leaves a client with Ray's plain-text 500.

Ray Serve's proxy answers a request whose replica died with a bare 500 ("Internal Server
Error", no body), and one past a deployment's queue with a plain-text 503. specdec serves
through a light front deployment instead (the application's ingress) that hands each request
to a model replica over a streaming deployment handle:

    client -> Ray's proxy -> Front (ASGI, this module) --handle--> SpecdecReplica.http(request)
                                                                     runs the OpenAI app on it,
                                                                     yields its ASGI messages

- Before the response has started (a completion is sent whole when it is done; a stream's
  head comes with its first token), a replica that died is retried on another one, up to
  ``RETRIES`` times. Greedy output is the same; a sampled one is a new draw of the same law.
- After it has started (a stream under way), the stream ends with an OpenAI error event.
- A deployment with no replica, or a full queue, is an OpenAI 503 body with Retry-After.
- A client that leaves cancels the handle's call: the replica's app sees ``http.disconnect``
  and cancels the request in its engine, as with ``specdec serve``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from specdec.serve.limits import error_body, error_messages

log = logging.getLogger("specdec.serve")

RETRIES = 2  # further replicas a request is tried on when the one serving it dies before answering
RETRY_AFTER = [(b"retry-after", b"1")]  # seconds: a replacement replica, or a queue place, is that near
CLOSE_GRACE_S = 5.0  # how long a relayed app may take to finish after its client left


def stream_error(message: str, code: str = "replica_unavailable") -> bytes:
    """The closing events of a stream cut short, as the server's own stream errors end (app.py)."""
    return b"data: " + error_body(message, code, "server_error") + b"\n\ndata: [DONE]\n\n"


def request_of(scope: dict, body: bytes) -> dict:
    """What a replica needs of an HTTP request (the parts of its ASGI scope that travel)."""
    keep = ("method", "path", "raw_path", "root_path", "query_string", "headers", "http_version", "scheme", "client", "server")
    return {**{k: scope[k] for k in keep if k in scope}, "headers": [(bytes(k), bytes(v)) for k, v in scope.get("headers", [])], "body": body}


async def run_app(app, request: dict) -> AsyncIterator[dict]:
    """Run the ASGI ``app`` on one relayed ``request`` (``request_of``); yield what it sends.
    Closing the iterator early (the client left) tells the app with ``http.disconnect``."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http", "root_path": "", "query_string": b"",
             **{k: v for k, v in request.items() if k != "body"}}  # fmt: skip
    sent: asyncio.Queue = asyncio.Queue()
    left = asyncio.Event()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": request["body"], "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    task = asyncio.ensure_future(app(scope, receive, sent.put))
    try:
        while True:
            get = asyncio.ensure_future(sent.get())
            await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():  # the app returned: what it sent is in the queue already
                get.cancel()
                while not sent.empty():
                    yield sent.get_nowait()
                task.result()
                return
            message = get.result()
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                return
    finally:
        left.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), CLOSE_GRACE_S)
            task.cancel()


def died(error: BaseException, kind: type) -> bool:
    """Whether ``error``, or what it wraps (a task error's cause, a chained exception), is a ``kind``."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            return True
        seen.add(id(error))
        error = getattr(error, "cause", None) or error.__cause__
    return False


class Front:
    """The front deployment's ASGI app: each HTTP request relayed to a model replica through
    ``handle`` (a streaming DeploymentHandle whose ``http`` method is ``run_app``)."""

    def __init__(self, handle: Any):
        self.handle = handle.options(stream=True)

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        for message in await self.relay(request_of(scope, body), send):
            await send(message)

    async def relay(self, request: dict, send) -> list[dict]:
        """Send the replica's answer; returns what is left to send (an error response), if anything."""
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

        reason = "no replica answered"
        for _ in range(1 + RETRIES):
            started, stream = False, None
            try:
                stream = self.handle.http.remote(request)
                async for message in stream:
                    started = started or message["type"] == "http.response.start"
                    await send(message)
                return []
            except asyncio.CancelledError:  # the client left: the replica's app hears of it
                if stream is not None:
                    stream.cancel()
                raise
            except BackPressureError:
                return error_messages(503, "every replica's queue is full; retry after a moment", "queue_full", RETRY_AFTER)
            except DeploymentUnavailableError as e:
                return error_messages(503, f"no replica is available ({e}); retry after a moment", "replica_unavailable", RETRY_AFTER)
            except Exception as e:
                if died(e, RayActorError):  # the replica died (or its node did) while serving this request
                    reason = f"the replica serving this request stopped ({type(e).__name__})"
                    if started:
                        log.warning("relayed stream cut short: %s", reason)
                        return [{"type": "http.response.body", "body": stream_error(f"{reason}; retry the request"), "more_body": False}]
                    log.warning("%s; retrying on another replica", reason)
                    continue
                log.exception("relayed request failed")  # the replica's app failed outside its own error handling: still an OpenAI body
                if started:
                    return [{"type": "http.response.body", "body": stream_error(f"the request failed: {type(e).__name__}", "server_error"), "more_body": False}]
                return error_messages(500, f"the request failed: {type(e).__name__}: {e}", "server_error")
        return error_messages(503, f"{reason}, {RETRIES} retries included; retry after a moment", "replica_unavailable", RETRY_AFTER)

"""The JSON-lines loop every peer worker of ``tools/bench_peers.py`` serves (``genai_worker.py``,
``openvino_worker.py``, ``llamacpp_worker.py``); standard library only, as it runs in the peers'
private venvs (the workers import it as a sibling: their folder is ``sys.path[0]``).

Requests are JSON lines on stdin, one reply line each on stdout, until stdin closes:

* ``{"cmd": "hello"}`` -> ``hello()``: ``{"version": ..., "unavailable": {mode: why}, ...}``
* ``{"cmd": "decode", "mode": M, "temperature": T, "prompt": [ids], "tokens": N, "seed": S}``
  -> ``decode(request)``: ``{"seconds", "tokens", "new_tokens", "stats", "ids"}``, or
  ``{"error": why}`` when it raised (the client then lists the mode as unavailable).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any


def redirect_stdout() -> Any:
    """The reply channel (the real stdout); afterwards fd 1 is stderr, so that anything a
    library prints, from Python or C, stays out of the replies."""
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return reply


def error_text(exc: BaseException) -> str:
    """``Type: first line of the message``."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


def serve(reply: Any, hello: Callable[[], dict], decode: Callable[[dict], dict]) -> int:
    """Answer ``hello`` and ``decode`` requests on stdin until it closes; returns the exit code."""
    for line in sys.stdin:
        req = json.loads(line)
        if req["cmd"] == "hello":
            out = hello()
        else:
            try:
                out = decode(req)
            except Exception as exc:  # noqa: BLE001 - the client marks the mode unavailable
                out = {"error": error_text(exc)}
        reply.write(json.dumps(out) + "\n")
    return 0

"""The client side of a peer worker: a script of ``tools/`` run by a private venv's python,
answering JSON lines (``tools/jsonl_worker.py`` is the server side)."""

from __future__ import annotations

import json
import os
import select
import subprocess
from pathlib import Path

from peers.base import ModeUnavailable, Peer, Sample

TOOLS = Path(__file__).resolve().parents[1]
REPLY_TIMEOUT_S = 900.0  # the longest a reply may take: loading models, or one request


class WorkerError(RuntimeError):
    """A worker process died or answered something that is not a reply."""


class Worker:
    """``python TOOLS/script '<spec json>'``; ``ask`` sends one request line and reads one reply.

    Lifecycle: started in ``__init__``, ended by ``close`` (stdin closed, then waited for).
    """

    def __init__(self, python: Path, script: str, spec: dict) -> None:
        self.name = script
        # Idle OpenMP threads (llama.cpp) must not spin between calls: the peers take turns on
        # the same cores, and a spinning pool would slow whichever peer runs next.
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
        self.proc = subprocess.Popen([str(python), str(TOOLS / script), json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env)

    def ask(self, request: dict) -> dict:
        """One JSON line out, one back; a dead worker raises with its exit code."""
        if self.proc.poll() is not None:
            raise WorkerError(f"{self.name} exited (rc={self.proc.returncode}); its stderr says why")
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], REPLY_TIMEOUT_S)  # one line per request: no read-ahead
        if not ready:
            self.proc.kill()
            raise WorkerError(f"{self.name} sent no reply in {REPLY_TIMEOUT_S:.0f} s to {request.get('cmd')}; killed it")
        line = self.proc.stdout.readline()
        if not line:
            raise WorkerError(f"{self.name} exited (rc={self.proc.wait()}); its stderr says why")
        try:
            return json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkerError(f"{self.name} answered a line that is not JSON: {line[:200]!r}") from exc

    def decode(self, unavailable: dict[str, str], mode: str, temperature: float, prompt: list[int], tokens: int,
               seed: int) -> Sample:
        """A ``decode`` request as a Sample; a mode the worker reported (or reports now) as
        failing raises ModeUnavailable with its reason."""
        if mode in unavailable:
            raise ModeUnavailable(unavailable[mode])
        reply = self.ask({"cmd": "decode", "mode": mode, "temperature": temperature, "prompt": prompt,
                          "tokens": tokens, "seed": seed})
        if "error" in reply:
            raise ModeUnavailable(reply["error"])
        return Sample(reply["seconds"], reply["tokens"], reply["new_tokens"], reply["stats"], reply["ids"])

    def close(self, timeout: float = 60) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class WorkerPeer(Peer):
    """A peer driven through a ``Worker``: subclasses set ``self.worker`` and ``self.unavailable``
    (mode/T -> why, from the worker's hello) in ``__init__``."""

    worker: Worker
    unavailable: dict[str, str]

    def decode(self, mode: str, temperature: float, prompt: list[int], tokens: int, seed: int) -> Sample:
        return self.worker.decode(self.unavailable, mode, temperature, prompt, tokens, seed)

    def close(self) -> None:
        self.worker.close()

"""``specdec serve`` as a child process on a free loopback port: for tests, benchmarks and scripts."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from specdec.serve.server import free_port


class ServerProcess:
    """``specdec serve BUNDLE ARGS --host 127.0.0.1 --port <free>``, output to ``log``.
    ``wait_ready`` polls /health (bounded); ``stop`` sends SIGTERM and returns the exit status;
    ``close`` ends it whatever its state. ``cwd``: where it runs (``python -m`` puts it first on
    the path: a benchmark runs another tree's ``specdec`` from there)."""

    def __init__(self, bundle: Path, *args: str, log: Path, env: dict | None = None, cwd: Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "specdec", "serve", str(bundle), "--host", "127.0.0.1", "--port", str(self.port), *args]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Return once /health answers 200; ``RuntimeError`` with the log if the server exits or
        is not ready after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"specdec serve exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):  # not bound yet, or 503 while loading
                pass
            time.sleep(0.2)
        self.close()
        raise RuntimeError(f"specdec serve not ready after {timeout} s:\n{self.log.read_text()}")

    def stop(self, timeout: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

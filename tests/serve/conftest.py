"""A real ``specdec serve`` process on a free loopback port, and the bundle it serves."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from specdec.serve.process import ServerProcess  # noqa: E402

from models import CHAT_TEMPLATE as TEMPLATE  # noqa: E402, F401 (test_server.py reads it from here)

KEY = "test-key-0123"
OTHER_KEY = "test-key-4567"  # a second tenant of the shared server (--isolate-tenants)


class Server(ServerProcess):
    """A server for one test module: started with ``--log-level warning``, without the
    environment's API key, ready (bounded wait) when built."""

    def __init__(self, bundle: Path, *args: str, log: Path, ready_within: float = 120.0):
        # the key is an argument or nothing; pytest's name of the current test can be longer than a process's environment may be
        env = {k: v for k, v in os.environ.items() if k not in ("SPECDEC_API_KEY", "PYTEST_CURRENT_TEST")}
        super().__init__(bundle, "--log-level", "warning", *args, log=log, env=env)
        self.wait_ready(ready_within)


@pytest.fixture(scope="session")
def server(chat_bundle, tmp_path_factory):
    """The shared server: the chat bundle, 4 rows, two API keys as two tenants (--isolate-tenants), model name "tiny",
    CORS for one origin, each response's speculative figures (vLLM's metrics.speculative_decoding)."""
    s = Server(chat_bundle[1], "--max-batch", "4", "--max-queue", "16", "--served-model-name", "tiny", "--api-key", KEY, "--api-key", OTHER_KEY,
               "--isolate-tenants", "--per-request-spec-decode-metrics", "summary", "--allowed-origins", "http://localhost:3000",
               log=tmp_path_factory.mktemp("logs") / "server.log")  # fmt: skip
    yield s
    s.close()


@pytest.fixture(scope="session")
def slow_bundle(tmp_path_factory):
    """A wider llama (~1 ms a token here) whose requests of a few hundred tokens are still running
    when a test disconnects or sends SIGTERM (bundles._slow); no batched graphs."""
    pytest.importorskip("torch")
    from bundles import cached

    return cached(tmp_path_factory, "slow") / "bundle"

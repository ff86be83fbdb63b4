"""The relay Ray Serve's front uses (specdec/serve/relay.py), in process: the OpenAI app run on a
relayed request answers as it does over HTTP, and a client that leaves mid-stream frees its
engine rows. Through Ray (a replica killed mid-request): tests/serve/test_ray.py."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def app(slow_bundle):
    from specdec.serve.app import build_app
    from specdec.serve.server import ServeConfig, load_engine, prepare

    cfg = ServeConfig(slow_bundle, threads=1, served_model_name="tiny", max_batch=1, gamma=0)
    state = prepare(cfg, bind=False)
    state.engine = load_engine(cfg, state)
    yield build_app(state), state.engine
    state.engine.close()


def relayed(body: dict) -> dict:
    from specdec.serve.relay import request_of

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"content-type", b"application/json")]}
    return request_of(scope, json.dumps(body).encode())


def test_a_relayed_completion_is_the_apps_answer(app):
    from fastapi.testclient import TestClient

    asgi, _ = app
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}

    messages = asyncio.run(_collect(asgi, body))
    assert [m["type"] for m in messages] == ["http.response.start", "http.response.body"]
    assert messages[0]["status"] == 200
    got = json.loads(messages[1]["body"])
    direct = TestClient(asgi).post("/v1/completions", json=body).json()
    assert got["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"] and len(got["choices"][0]["token_ids"]) == 12

    refused = asyncio.run(_collect(asgi, {**body, "max_tokens": -1}))  # the app's own refusal, relayed as it is
    assert refused[0]["status"] == 400 and json.loads(refused[1]["body"])["error"]["type"] == "invalid_request_error"


async def _collect(asgi, body: dict) -> list[dict]:
    from specdec.serve.relay import run_app

    return [m async for m in run_app(asgi, relayed(body))]


def test_a_client_that_leaves_a_relayed_stream_frees_its_rows(app):
    """Closing the relay after a few events (the front's call cancelled) tells the app the client
    left: the engine drops the request instead of decoding its 480 tokens."""
    from specdec.serve.relay import run_app

    asgi, engine = app
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 480, "temperature": 0, "ignore_eos": True, "stream": True}

    async def leave_early() -> int:
        events = 0
        stream = run_app(asgi, relayed(body))
        async for m in stream:
            events += m["type"] == "http.response.body" and m["body"].startswith(b"data: {")
            if events == 3:
                break
        await stream.aclose()
        return events

    assert asyncio.run(leave_early()) == 3
    deadline = time.monotonic() + 10
    while engine.active and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.active == 0

"""Hostile request bodies against a real server (serve/limits.py, the bounds in serve/protocol.py).

A 200 MiB chunked body is refused once it passes the limit, with the server's memory flat; a
Content-Length over the limit is refused before any body byte; a 100,000-deep JSON body, a
list over its bound and other hostile values get a 4xx OpenAI error body, never a 500.
"""

from __future__ import annotations

import json
import select
import socket
import time
from typing import Iterable

import httpx
import pytest
from conftest import KEY

from specdec.serve.limits import MAX_BODY, MAX_DEPTH
from specdec.serve.protocol import BOUNDS, MAX_CHOICES

MiB = 1 << 20
RSS_TOLERANCE = 50 * MiB  # allocator noise and one transport buffer; the body read in full would be 200 MiB
HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def rss(pid: int) -> int:
    """Resident memory of process ``pid`` in bytes (Linux)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def check_error(status: int, body: bytes, want: int, names: str = "") -> dict:
    """An OpenAI-shaped error body with HTTP status ``want`` whose message contains ``names``."""
    assert status == want, (status, body[:300])
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] and names in err["message"], err
    assert "\n" not in err["message"] and "Traceback" not in err["message"]
    return err


def raw_post(port: int, headers: dict, chunks: Iterable[bytes], send_timeout: float = 10.0) -> tuple[int, bytes, int]:
    """POST ``chunks`` over a raw socket to /v1/completions, stopping as soon as the server answers
    (or stops reading for ``send_timeout`` s); returns (status, body, bytes of body sent)."""
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=send_timeout) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}\r\n".encode())
        try:
            for chunk in chunks:  # bounded by the caller's generator
                if select.select([s], [], [], 0)[0]:
                    break  # the answer is here: stop sending
                s.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass  # the server closed, or stopped reading
        reply = b""
        s.settimeout(30)
        try:
            while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < length(reply):
                data = s.recv(65536)
                if not data:
                    break
                reply += data
        except ConnectionResetError:
            pass
    head_, _, body = reply.partition(b"\r\n\r\n")
    status = int(head_.split(b" ", 2)[1]) if head_ else 0
    return status, body, sent


def length(reply: bytes) -> int:
    for line in reply.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            return int(v)
    return 1 << 30


def chunked(total: int, piece: int = MiB) -> Iterable[bytes]:
    """A JSON-looking chunked body of ``total`` bytes of prompt text, then its last chunk."""
    start = b'{"model": "tiny", "prompt": "'
    yield b"%x\r\n%s\r\n" % (len(start), start)
    block = b"%x\r\n%s\r\n" % (piece, b"a" * piece)
    for _ in range(total // piece):
        yield block
    yield b"0\r\n\r\n"


def test_chunked_body_stops_at_the_limit_with_memory_flat(server):
    before = rss(server.proc.pid)
    status, body, sent = raw_post(server.port, {**HEADERS, "Transfer-Encoding": "chunked"}, chunked(200 * MiB))
    after = rss(server.proc.pid)
    check_error(status, body, 413, f"the limit is {MAX_BODY} bytes")
    assert sent < 100 * MiB, sent  # the server stopped reading long before the end
    assert after - before < RSS_TOLERANCE, (before, after)
    assert httpx.get(server.url + "/health").status_code == 200


def test_content_length_over_the_limit_is_refused_before_reading(server):
    status, body, sent = raw_post(server.port, {**HEADERS, "Content-Length": str(200 * MiB)}, [b"{"] * 0)
    check_error(status, body, 413, f"is {200 * MiB} bytes")
    assert sent == 0


def test_body_at_the_limit_is_read(server):
    """A body of MAX_BODY bytes is read and parsed, then refused for its prompt's length, not
    its size, and without tokenizing it (8 MiB of text takes ~14 s of a core to tokenize)."""
    filler = MAX_BODY - len(json.dumps({"model": "tiny", "prompt": ""}))
    r = httpx.post(server.url + "/v1/completions", headers=HEADERS, content=json.dumps({"model": "tiny", "prompt": "a" * filler}), timeout=60)
    assert len(r.request.content) == MAX_BODY
    err = check_error(r.status_code, r.content, 400, f"prompt: {filler} characters; with this tokenizer no text over")
    assert err["param"] == "prompt"


def test_tokenize_counts_text_past_the_context(server):
    """/tokenize is not bounded by the context as prompts are: lm-eval counts whole documents
    through it and cuts them into windows itself."""
    r = httpx.post(server.url + "/tokenize", headers=HEADERS, json={"model": "tiny", "prompt": "c d " * 50_000}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["count"] > r.json()["max_model_len"], r.json()["count"]


def test_a_chat_too_long_to_fit_is_refused_naming_messages(server):
    r = httpx.post(server.url + "/v1/chat/completions", headers=HEADERS, timeout=60,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "b" * (4 << 20)}]})  # fmt: skip
    err = check_error(r.status_code, r.content, 400, "characters; with this tokenizer no text over")
    assert err["param"] == "messages"


@pytest.mark.parametrize("body", ["[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000,
                                  '{"model": "tiny", "prompt": ' + "[" * 100_000 + "1" + "]" * 100_000 + "}",
                                  '{"model": "tiny", "prompt": "x", "stop": ' + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1) + "}"],
                         ids=["list", "object", "prompt", "stop"])  # fmt: skip
def test_deep_json_gets_400(server, body):
    r = httpx.post(server.url + "/v1/completions", headers=HEADERS, content=body, timeout=30)
    check_error(r.status_code, r.content, 400, f"the limit is {MAX_DEPTH}")


def test_deep_brackets_inside_strings_are_text(server):
    r = httpx.post(server.url + "/v1/completions", headers=HEADERS, timeout=60,
                   json={"model": "tiny", "prompt": "[" * 100 + '\\"{' * 20, "max_tokens": 2, "temperature": 0})  # fmt: skip
    assert r.status_code == 200, r.text


def test_ten_thousand_stop_strings_get_400_naming_stop(server):
    r = httpx.post(server.url + "/v1/completions", headers=HEADERS, json={"model": "tiny", "prompt": "x", "stop": ["a"] * 10_000})
    err = check_error(r.status_code, r.content, 400, f"stop: 10000 entries; the limit is {BOUNDS['stop'][0]}")
    assert err["param"] == "stop"


def over(kind: str) -> int:
    return BOUNDS[kind][0] + 1


LISTS = [  # (endpoint, body, field, bound)
    ("completions", {"stop": ["s"] * over("stop")}, "stop", BOUNDS["stop"][0]),
    ("completions", {"stop": "s" * over("stop string")}, "stop", BOUNDS["stop string"][0]),
    ("completions", {"stop_token_ids": [1] * over("stop_token_ids")}, "stop_token_ids", BOUNDS["stop_token_ids"][0]),
    ("completions", {"logit_bias": {str(i): 1.0 for i in range(over("logit_bias"))}}, "logit_bias", BOUNDS["logit_bias"][0]),
    ("completions", {"prompt": [1] * over("prompt ids")}, "prompt", BOUNDS["prompt ids"][0]),
    ("completions", {"prompt": ["p"] * over("prompt list")}, "prompt", BOUNDS["prompt list"][0]),
    ("completions", {"n": MAX_CHOICES + 1}, "n", MAX_CHOICES),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}] * over("messages")}, "messages", BOUNDS["messages"][0]),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * over("content")}]}, "messages.0.content", BOUNDS["content"][0]),
    ("chat/completions", {"chat_template_kwargs": {f"k{i}": 1 for i in range(over("chat_template_kwargs"))}}, "chat_template_kwargs", BOUNDS["chat_template_kwargs"][0]),
]  # fmt: skip


@pytest.mark.parametrize("endpoint, extra, field, bound", LISTS, ids=[f"{c[2]}-{c[3]}" for c in LISTS])
def test_list_over_its_bound_gets_400_naming_field_and_bound(server, endpoint, extra, field, bound):
    base = {"model": "tiny", **({"prompt": "x"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "x"}]})}
    r = httpx.post(f"{server.url}/v1/{endpoint}", headers=HEADERS, json={**base, **extra}, timeout=30)
    err = check_error(r.status_code, r.content, 400, field)
    assert str(bound) in err["message"], err


HOSTILE = [  # bodies that once reached code paths outside validation
    {"prompt": [10**30, 5]}, {"prompt": [-1]}, {"prompt": [2**63]}, {"prompt": "x", "seed": 2**80}, {"prompt": "x", "seed": -1},
    {"prompt": "x", "top_k": 10**12}, {"prompt": "x", "top_p": 1e308}, {"prompt": "x", "temperature": 1e308},
    {"prompt": "x", "max_tokens": -1}, {"prompt": "x", "max_tokens": 10**30}, {"prompt": "x", "stop_token_ids": [10**30]},
    {"prompt": "x", "stop_token_ids": [-5]}, {"prompt": "x", "stop": [""]}, {"prompt": "x", "stop": ""}, {"prompt": []},
    {"prompt": [[]]}, {"prompt": "\ud800"}, {"prompt": "x", "stream_options": {"include_usage": 1}}, {"prompt": "x", "user": {}},
]  # fmt: skip
HOSTILE_CHAT = [
    {"chat_template_kwargs": {"messages": []}}, {"chat_template_kwargs": {"add_generation_prompt": "no"}},
    {"messages": [{"role": "user", "content": None}]}, {"messages": [{"role": "user", "content": []}]},
    {"chat_template_kwargs": {"x": [[[[1]]]]}}, {"max_completion_tokens": 0},
]  # fmt: skip


def test_no_body_gets_a_500(server):
    with httpx.Client(base_url=server.url, headers=HEADERS, timeout=60) as c:
        for extra in HOSTILE:
            r = c.post("/v1/completions", content=json.dumps({"model": "tiny", "max_tokens": 2, **extra}))
            assert r.status_code < 500 and ("error" in r.json()) == (r.status_code >= 400), (extra, r.status_code, r.text[:300])
        for extra in HOSTILE_CHAT:
            r = c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], **extra})
            assert r.status_code < 500, (extra, r.status_code, r.text[:300])
        for raw in (b"NaN", b"\xff\xfe", b'{"model": "tiny", "prompt": "x", "temperature": NaN}', b"", b'"' * 10, b"\\" * 100, b"[]" * 1000):
            r = c.post("/v1/completions", content=raw)
            check_error(r.status_code, r.content, 400)
    time.sleep(0.1)
    assert httpx.get(server.url + "/health").status_code == 200

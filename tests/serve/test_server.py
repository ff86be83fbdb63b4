"""``specdec serve`` end to end: a real server process, the official ``openai`` client, httpx for raw HTTP."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from conftest import KEY, OTHER_KEY, Server
from prometheus_client.parser import text_string_to_metric_families

openai = pytest.importorskip("openai")

PROMPTS = ["def add(a, b):", "class Stack:\n", "import os\n", "for i in range(10):", "with open(path) as f:",
           "if __name__ == '__main__':", "    def push(self, x):", "print(i, i * i)"]  # fmt: skip


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(chat_bundle):
    """Greedy tokens of the single-request decoder (what ``specdec generate`` runs)."""
    from specdec.runtime.decoder import SpeculativeDecoder

    dec = SpeculativeDecoder.load(chat_bundle[1])

    def run(prompt, n, ids=None, **kw):
        if ids is not None:  # the text of these token ids, as the server's tokenizer decodes them
            return dec.codec.decode(ids)
        return dec.generate(prompt, max_new_tokens=n, **kw)

    return run


def metrics(url: str) -> dict[str, float]:
    """/metrics as {sample name{labels}: value}, parsed by prometheus_client's own parser."""
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def extra(obj, name):
    return (obj.model_extra or {})[name]


def spec(obj) -> dict:
    """A response's (or last chunk's) speculative figures: vLLM's metrics.speculative_decoding."""
    return extra(obj, "metrics")["speculative_decoding"]


# -- outputs are the target's ------------------------------------------------------------------


def test_served_greedy_equals_specdec_generate(server, client, chat_bundle, reference):
    """Text prompts and token-id prompts: served tokens equal the single-request decoder's, and
    one prompt is checked against the ``specdec generate`` command itself."""
    for prompt in PROMPTS[:3]:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})  # fmt: skip
        ref = reference(prompt, 40, ignore_eos=True)
        assert extra(r.choices[0], "token_ids") == ref.tokens
        assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 40 and r.usage.prompt_tokens == len(extra(r, "prompt_token_ids"))
        got = spec(r)
        assert got["num_draft_tokens"] > 0 and 0 <= got["num_accepted_draft_tokens"] <= got["num_draft_tokens"]
        assert sum(got["acceptance_histogram"]) == got["num_spec_steps"] and len(got["acceptance_histogram"]) == got["num_spec_tokens"] + 1
        assert sum(j * n for j, n in enumerate(got["acceptance_histogram"])) == got["num_accepted_draft_tokens"]
    ids = [5, 17, 99, 3, 250, 42]
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=30, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert extra(r, "prompt_token_ids") == ids
    assert extra(r.choices[0], "token_ids") == reference(ids, 30, ignore_eos=True).tokens
    cli = subprocess.run([sys.executable, "-m", "specdec", "generate", str(chat_bundle[1]), "--prompt", PROMPTS[3], "--max-new-tokens", "40",
                          "--ignore-eos", "--json"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    r = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=40, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert extra(r.choices[0], "token_ids") == json.loads(cli.stdout)["tokens"]


def test_eight_requests_in_flight_each_equal_their_own_greedy_output(server, reference):
    """8 concurrent requests (4 rows, 4 queued; half streamed) with different lengths: each is
    its own greedy output, token for token."""
    lengths = [60, 25, 90, 40, 70, 30, 50, 80]
    got = in_flight(server.url, "tiny", PROMPTS, lengths, KEY)
    for i, ids in enumerate(got):
        assert ids == reference(PROMPTS[i], lengths[i], ignore_eos=True).tokens, f"request {i}"


def in_flight(url: str, model: str, prompts: list, lengths: list[int], key: str | None = None) -> list[list[int]]:
    """Concurrent greedy completions, every other one streamed, through the official async client:
    token ids per request (request i: ``prompts[i]``, ``lengths[i]`` tokens)."""

    async def one(c, i):
        kw = dict(model=model, prompt=prompts[i], max_tokens=lengths[i], temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
        if i % 2:
            ids = []
            async for chunk in await c.completions.create(stream=True, **kw):
                ids += extra(chunk.choices[0], "token_ids") if chunk.choices else []
            return ids
        return extra((await c.completions.create(**kw)).choices[0], "token_ids")

    async def main():
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key or "none", max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(one(c, i) for i in range(len(prompts))))
        finally:
            await c.close()

    return asyncio.run(main())


def test_streaming_chunks_add_up_to_the_completion(client):
    kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=50, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in extra(c.choices[0], "token_ids")]
    assert text == whole.choices[0].text and ids == extra(whole.choices[0], "token_ids")
    assert len([c for c in chunks if c.choices]) > 2  # streamed, not one blob
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason == "length" and spec(last)["num_draft_tokens"] > 0
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 50
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()  # the usage chunk's totals are the whole response's
    assert extra(chunks[0], "prompt_token_ids") == extra(whole, "prompt_token_ids")
    # n = 2 with a stop string (tokens past it are neither returned nor billed), streamed and not
    kw = {**kw, "n": 2, "temperature": 1.0, "seed": 3, "stop": ["\n"]}
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert whole.usage.completion_tokens == sum(len(extra(c, "token_ids")) for c in whole.choices)


def test_chat_uses_the_bundles_template(server, client, chat_bundle, reference):
    """The prompt is the source tokenizer's own ``apply_chat_template``; the reply its greedy output."""
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    want = AutoTokenizer.from_pretrained(chat_bundle[0]).apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    ref = reference(want, 30, ignore_eos=True)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=30, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert extra(r, "prompt_token_ids") == list(want)
    assert extra(r.choices[0], "token_ids") == ref.tokens
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=30, temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model="tiny", prompt=PROMPTS[1], max_tokens=40, temperature=1.0, extra_body={"return_token_ids": True, "ignore_eos": True})
    a, b = (extra(client.completions.create(seed=7, **kw).choices[0], "token_ids") for _ in range(2))
    assert a == b
    others = [extra(client.completions.create(seed=s, **kw).choices[0], "token_ids") for s in (8, 9, 10)]
    assert any(o != a for o in others)  # the seed is used


def test_stop_strings_and_stop_token_ids(client, reference):
    kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=60, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
    full = client.completions.create(**kw).choices[0]
    text, ids = full.text, extra(full, "token_ids")
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop and text.find(stop) > 0
    whole = client.completions.create(stop=[stop, "\x00never"], **kw)
    r = whole.choices[0]
    assert r.text == text[: text.find(stop)] and r.finish_reason == "stop"
    # the tokens end at the one that completed the stop string, and usage bills exactly those
    end = text.find(stop) + len(stop)
    k = next(k for k in range(1, len(ids) + 1) if len(reference(PROMPTS[0], 0, ids=ids[:k])) >= end)
    assert extra(r, "token_ids") == ids[:k] and whole.usage.completion_tokens == k
    streamed = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == r.text and streamed[-1].choices[0].finish_reason == "stop"
    assert [t for c in streamed for t in extra(c.choices[0], "token_ids")] == ids[:k]
    at = 10  # a token id that first appears at position `at` ends the request there (kept)
    tok = ids[at]
    first = ids.index(tok)
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=60, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True, "stop_token_ids": [tok]})
    assert extra(r.choices[0], "token_ids") == ids[: first + 1] and r.choices[0].finish_reason == "stop"


# -- metrics -------------------------------------------------------------------------------------


def test_metrics_parse_and_add_up_to_the_requests_sent(server, client):
    """Over 100 requests (streamed and whole, greedy and sampled), Prometheus' counters move by
    what the responses said: outcomes, tokens, and each response's metrics.speculative_decoding."""
    before = metrics(server.url)
    sent = {"length": 0, "stop": 0, "invalid": 0}
    completion = drafted = accepted = steps = 0
    for i in range(99):
        kw = dict(model="tiny", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=4 + i % 13, temperature=(0, 1)[i % 2], seed=i, extra_body={"ignore_eos": i % 3 > 0})
        if i % 4 == 3:
            chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
            r, finish = chunks[-1], [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            assert "metrics" not in (chunks[0].model_extra or {})  # on the last chunk only
        else:
            r = client.completions.create(**kw)
            finish = r.choices[0].finish_reason
        sent[finish] += 1
        completion += r.usage.completion_tokens
        got = spec(r)
        drafted, accepted, steps = drafted + got["num_draft_tokens"], accepted + got["num_accepted_draft_tokens"], steps + got["num_spec_steps"]
        assert got["draft_acceptance_rate"] == (got["num_accepted_draft_tokens"] / got["num_draft_tokens"] if got["num_draft_tokens"] else 0.0)
    nulls = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8,  # null means the default, as OpenAI takes it
                                      extra_body={"temperature": None, "top_p": None, "n": None, "stream": None, "seed": 3})
    sent[nulls.choices[0].finish_reason] += 1
    completion += nulls.usage.completion_tokens
    drafted += spec(nulls)["num_draft_tokens"]
    accepted += spec(nulls)["num_accepted_draft_tokens"]
    steps += spec(nulls)["num_spec_steps"]
    for bad in ({"temperature": -1}, {"n": 0}, {"max_tokens": "ten"}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt="x", extra_body=bad)
        sent["invalid"] += 1
    after = metrics(server.url)
    d = lambda k: after[k] - before.get(k, 0.0)  # noqa: E731
    for outcome, n in sent.items():
        assert d(f"specdec_requests_total{{outcome={outcome}}}") == n
    assert d("specdec_generation_tokens_total") == completion
    assert d("specdec_spec_decode_num_draft_tokens_total") == drafted and d("specdec_spec_decode_num_accepted_tokens_total") == accepted
    assert d("specdec_spec_decode_num_drafts_total") == steps and drafted > 0
    assert sum(d(f"specdec_spec_decode_num_accepted_tokens_per_pos_total{{position={p}}}") for p in range(1, 5)) == accepted
    assert d("specdec_e2e_request_latency_seconds_count") == 100 and d("specdec_time_to_first_token_seconds_count") == 100
    assert after["specdec_num_requests_running"] == 0 and after["specdec_num_requests_waiting"] == 0
    assert 0 < after["specdec_spec_decode_acceptance_rate"] <= 1
    assert after["specdec_spec_decode_gamma_count"] >= d("specdec_spec_decode_num_drafts_total") > 0


def test_tenants_never_reuse_each_others_prefix(server, client):
    """--isolate-tenants with two keys, through the official client: the second tenant sending the
    first's 300-token prompt feeds all of it (the prefix-hit counter does not move), the same tenant
    gets its hit; a tenant's own cache_salt divides its cache further. Outputs never change.
    Prometheus counts hits per salt class, never per tenant. (Time to first token, cold against
    the other tenant's, is bench-serve --isolation's.)"""
    other = openai.OpenAI(base_url=server.url + "/v1", api_key=OTHER_KEY, max_retries=0, timeout=60)
    prompt = [int(t) for t in np.random.default_rng(11).integers(3, 250, 300)]

    def send(c, **kw):
        before = metrics(server.url)
        r = c.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True, **kw})
        after = metrics(server.url)
        d = {cls: after[f"specdec_prefix_cache_hits_by_salt_class_total{{salt_class={cls}}}"] - before[f"specdec_prefix_cache_hits_by_salt_class_total{{salt_class={cls}}}"]
             for cls in ("none", "request", "tenant")}  # fmt: skip
        assert d["none"] == d["request"] == 0  # every request of an isolating server is salted by its tenant
        assert after["specdec_prefix_cache_hits_total"] - before["specdec_prefix_cache_hits_total"] == d["tenant"]
        return extra(r.choices[0], "token_ids"), d["tenant"]

    first, _ = send(client)
    assert send(other) == (first, 0)  # the other tenant: a cold start
    assert send(client) == (first, len(prompt) - 1)  # the same tenant: its hit
    assert send(other) == (first, len(prompt) - 1)
    assert send(client, cache_salt="project-x") == (first, 0)  # a salt of its own within the tenant
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert KEY not in text and OTHER_KEY not in text and "project-x" not in text
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.completions.create(model="tiny", prompt="x", max_tokens=1, extra_body={"cache_salt": ""})


def test_prompt_lists_and_n_give_one_choice_each_in_order(client, reference):
    """A list of prompts (text and token ids) with n = 2: choice i * n + j is prompt i's, each
    equal to that prompt's greedy output; usage counts each prompt once and every choice's tokens."""
    ids = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=1, extra_body={"return_token_ids": True})
    prompt_ids = extra(ids, "prompt_token_ids")
    prompts = [PROMPTS[0], PROMPTS[1]]
    r = client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=20, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        want = reference(prompts[c.index // 2], 20)
        assert extra(c, "token_ids") == want.tokens and c.text == want.text
    assert r.usage.completion_tokens == 80
    assert r.usage.prompt_tokens == sum(len(extra(r.choices[2 * i], "prompt_token_ids")) for i in range(2))
    by_ids = client.completions.create(model="tiny", prompt=[prompt_ids, prompt_ids[:3]], max_tokens=12, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert [extra(c, "token_ids") for c in by_ids.choices] == [reference(prompt_ids, 12).tokens, reference(prompt_ids[:3], 12).tokens]


def test_n_seeded_choices_draw_from_seed_plus_j(client):
    """Sampled with a seed, choice j of n equals a lone request seeded seed + j (reproducible);
    streamed, the chunks of each index add up to the same choices, each ending once."""
    kw = dict(model="tiny", prompt=PROMPTS[1], max_tokens=20, temperature=1.0, extra_body={"return_token_ids": True, "ignore_eos": True})
    r = client.completions.create(n=3, seed=11, **kw)
    for j, c in enumerate(r.choices):
        assert extra(c, "token_ids") == extra(client.completions.create(seed=11 + j, **kw).choices[0], "token_ids")
    chunks = list(client.completions.create(n=3, seed=11, stream=True, **kw))
    for j, c in enumerate(r.choices):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == j]
        assert "".join(x.text for x in mine) == c.text
        assert [x.finish_reason for x in mine if x.finish_reason] == ["length"]


def test_what_clients_send_back_is_accepted(server):
    """No model (the served one), an assistant message as the openai library dumps it (null
    refusal, tool_calls, function_call, audio, annotations) and response_format text: all 200."""
    headers = {"Authorization": f"Bearer {KEY}"}
    echoed = {"role": "assistant", "content": "Hi.", "refusal": None, "tool_calls": None, "function_call": None, "audio": None, "annotations": []}
    body = {"messages": [{"role": "user", "content": "hi"}, echoed, {"role": "user", "content": "again"}], "max_tokens": 5,
            "response_format": {"type": "text"}, "temperature": 0}  # fmt: skip
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny" and r.json()["choices"][0]["message"]["content"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, headers=headers, timeout=60)
    assert r.status_code == 200, r.text


def test_tokenize_and_detokenize_as_vllm(server, client):
    """/tokenize gives the ids a completion's prompt becomes (and a chat's, through the
    template), with count and max_model_len; /detokenize turns ids back into the text;
    /tokenizer_info names the special tokens and the chat template."""
    headers = {"Authorization": f"Bearer {KEY}"}
    post = lambda route, body: httpx.post(server.url + route, json=body, headers=headers, timeout=30)  # noqa: E731
    r = client.completions.create(model="tiny", prompt=PROMPTS[4], max_tokens=1, extra_body={"return_token_ids": True})
    t = post("/tokenize", {"model": "tiny", "prompt": PROMPTS[4]}).json()
    assert t["tokens"] == extra(r, "prompt_token_ids") and t["count"] == len(t["tokens"]) and t["max_model_len"] == 512
    bare = post("/tokenize", {"prompt": PROMPTS[4], "add_special_tokens": False}).json()["tokens"]
    assert post("/detokenize", {"tokens": bare}).json() == {"prompt": PROMPTS[4]}
    messages = [{"role": "user", "content": "hi there"}]
    c = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, extra_body={"return_token_ids": True})
    assert post("/tokenize", {"messages": messages}).json()["tokens"] == extra(c, "prompt_token_ids")
    for route, body, status, name in (("/tokenize", {"prompt": "x", "messages": messages}, 400, "either"),
                                      ("/tokenize", {"prompt": 5}, 400, "prompt"),
                                      ("/detokenize", {"tokens": [1, 10**6]}, 400, "1000000"),
                                      ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "nope")):  # fmt: skip
        check_error(post(route, body), status, name)
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}, timeout=30).status_code == 401
    info = httpx.get(server.url + "/tokenizer_info", headers=headers, timeout=30).json()  # what lm-eval's remote tokenizer reads
    from conftest import TEMPLATE

    assert info["chat_template"] == TEMPLATE and info["model_max_length"] == 512
    assert post("/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"] == [1]  # the llama pair's EOS id


def test_logprobs_and_echo_are_the_targets(server, client, chat_bundle):
    """Completions' logprobs=k and chat's logprobs/top_logprobs, streamed and not: every value is
    the PyTorch target's log-softmax at that position (1e-4, the export's logits bound), drafted
    tokens included; echo with logprobs and max_tokens=0 returns the prompt's (the first null),
    as lm-evaluation-harness's loglikelihood requests read them."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(chat_bundle[0]).eval()

    def ref(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()  # row t predicts ids[t + 1]

    kw = dict(model="tiny", max_tokens=16, extra_body={"return_token_ids": True, "ignore_eos": True})
    for temperature in (0, 1.0):
        r = client.completions.create(prompt=PROMPTS[0], logprobs=2, temperature=temperature, seed=4, **kw)
        c, prompt = r.choices[0], extra(r, "prompt_token_ids")
        ids = prompt + extra(c, "token_ids")
        lp = ref(ids)
        assert len(c.logprobs.token_logprobs) == len(extra(c, "token_ids")) == 16
        for j, (tok, v, top) in enumerate(zip(extra(c, "token_ids"), c.logprobs.token_logprobs, c.logprobs.top_logprobs)):
            row = lp[len(prompt) - 1 + j]
            best = np.sort(row)[-2:]  # two ids may decode to one string (a byte token: "\ufffd"), so a dict may hold one
            assert abs(v - row[tok]) < 1e-4 and 1 <= len(top) <= 2 and all(np.abs(best - x).min() < 1e-4 for x in top.values())
        offsets = c.logprobs.text_offset  # per-token text: a split UTF-8 character decodes to "\ufffd" on its own
        assert len(c.logprobs.tokens) == 16 and offsets[0] == 0 and all(a <= b for a, b in zip(offsets, offsets[1:]))
        # drafted tokens were scored: the seeded sampled request keeps the bundle's fixed γ (a seed
        # reproduces), while greedy under the server's --gamma auto may run γ = 0 on a loaded machine
        assert spec(r)["num_accepted_draft_tokens"] > 0 or not temperature
    echo = client.completions.create(model="tiny", prompt=PROMPTS[0], echo=True, logprobs=0, max_tokens=0)
    c = echo.choices[0]
    lp = ref(prompt)
    assert c.text == PROMPTS[0] and c.logprobs.token_logprobs[0] is None and echo.usage.completion_tokens == 0
    assert np.allclose(c.logprobs.token_logprobs[1:], [lp[t - 1][prompt[t]] for t in range(1, len(prompt))], atol=1e-4)
    streamed = list(client.completions.create(prompt=PROMPTS[0], logprobs=1, temperature=0, stream=True, **kw))
    values = [v for ch in streamed if ch.choices and ch.choices[0].logprobs for v in ch.choices[0].logprobs.token_logprobs]
    greedy = client.completions.create(prompt=PROMPTS[0], logprobs=1, temperature=0, **kw).choices[0]
    assert np.allclose(values, greedy.logprobs.token_logprobs, atol=1e-6)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=3,
                                          max_tokens=8, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})  # fmt: skip
    ids = extra(chat, "prompt_token_ids") + extra(chat.choices[0], "token_ids")
    lp = ref(ids)
    n = len(extra(chat, "prompt_token_ids"))
    content = chat.choices[0].logprobs.content
    assert [e.token for e in content] and len(content) == 8 and all(len(e.top_logprobs) == 3 for e in content)
    assert all(abs(e.logprob - lp[n - 1 + j][t]) < 1e-4 for j, (e, t) in enumerate(zip(content, ids[n:])))


PENALTIES = [  # vLLM's fields, each applied (the runtime's tests check them against PyTorch)
    dict(repetition_penalty=1.8),
    dict(frequency_penalty=1.5, presence_penalty=2.0),
    dict(min_p=0.3, temperature=1.0, seed=5),
    dict(min_tokens=20, stop_token_ids=None),  # stop_token_ids: the plain output's third token (filled in below)
]


def test_a_chat_reuses_its_history_and_stays_exact(server, client, reference):
    """Three chat turns, each reply sent back: every reply equals the decoder on the turn's
    rendered prompt, and the prefix-cache counters show turns 2 and 3 kept their history."""
    messages = [{"role": "user", "content": "def add(a, b):"}]
    before = metrics(server.url)
    kept = 0
    for turn in ("now subtract", "and multiply", "and divide"):
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                           extra_body={"return_token_ids": True, "ignore_eos": True})  # fmt: skip
        prompt = extra(r, "prompt_token_ids")
        assert extra(r.choices[0], "token_ids") == reference(prompt, 16, ignore_eos=True).tokens
        kept += len(prompt) if len(messages) > 1 else 0
        messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": turn}]
    after = metrics(server.url)
    hits = after["specdec_prefix_cache_hits_total"] - before["specdec_prefix_cache_hits_total"]
    queries = after["specdec_prefix_cache_queries_total"] - before["specdec_prefix_cache_queries_total"]
    assert queries > 0 and hits >= 0.5 * kept > 0, (hits, queries, kept)  # the template re-renders the reply: most of the history is kept
    assert "specdec_prefix_cache_evictions_total" in after


def test_penalties_bias_and_min_p_are_applied_exactly(client, reference):
    """Each sampling field the official client sends gives what the decoder gives with the same
    settings, token for token, and changes the output (so it is applied, not ignored)."""
    prompt = PROMPTS[1]
    plain = reference(prompt, 24, ignore_eos=True).tokens
    for kw in [*PENALTIES, dict(logit_bias={plain[0]: -100.0, plain[2]: -5.0})]:
        if "stop_token_ids" in kw:
            kw = {**kw, "stop_token_ids": [plain[2]]}
        sampling = {"temperature": 0, **kw}
        std = {k: sampling.pop(k) for k in ("frequency_penalty", "presence_penalty", "logit_bias", "seed", "temperature") if k in sampling}
        if "logit_bias" in std:
            std["logit_bias"] = {str(t): b for t, b in std["logit_bias"].items()}
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, **std, extra_body={"return_token_ids": True, "ignore_eos": True, **sampling})
        want = reference(prompt, 24, ignore_eos=True, **kw).tokens
        assert extra(r.choices[0], "token_ids") == want, kw
        if "min_p" not in kw:
            assert want != plain, f"{kw} does not change this output: the test would not see it ignored"
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=12, temperature=0, presence_penalty=2.0,
                                          frequency_penalty=1.0, extra_body={"return_token_ids": True, "ignore_eos": True})  # fmt: skip
    ids = extra(chat, "prompt_token_ids")
    assert extra(chat.choices[0], "token_ids") == reference(ids, 12, ignore_eos=True, presence_penalty=2.0, frequency_penalty=1.0).tokens


def test_best_of_returns_the_highest_cumulative_logprob(client):
    """best_of=4, n=2, seeded: the rows are the lone requests seeded seed + j, and the two
    returned are those with the highest sum of token logprobs, best first; usage bills all four."""
    kw = dict(model="tiny", prompt=PROMPTS[3], max_tokens=12, temperature=1.0, extra_body={"return_token_ids": True, "ignore_eos": True})
    rows = [client.completions.create(seed=7 + j, logprobs=0, **kw).choices[0] for j in range(4)]
    sums = [sum(c.logprobs.token_logprobs) for c in rows]
    order = sorted(range(4), key=lambda j: -sums[j])
    r = client.completions.create(seed=7, n=2, best_of=4, **kw)
    assert [extra(c, "token_ids") for c in r.choices] == [extra(rows[j], "token_ids") for j in order[:2]]
    assert [c.index for c in r.choices] == [0, 1] and all(c.logprobs is None for c in r.choices)  # not asked: not returned
    assert r.usage.completion_tokens == 48
    with_lps = client.completions.create(seed=7, n=1, best_of=4, logprobs=1, **kw).choices[0]
    assert extra(with_lps, "token_ids") == extra(rows[order[0]], "token_ids") and len(with_lps.logprobs.top_logprobs) == 12


def test_beam_search_is_the_decoders_and_hugging_faces(client, chat_bundle):
    """use_beam_search (vLLM's field): width best_of, else n; the best n returned, best first,
    equal to ``SpeculativeDecoder.beam_search`` (itself equal to transformers' generate(num_beams=w),
    tests/runtime/test_beam_search.py), on completions and chat; usage counts the returned tokens."""
    from specdec.runtime.decoder import SpeculativeDecoder

    dec = SpeculativeDecoder.load(chat_bundle[1])
    want = dec.beam_search(PROMPTS[1], num_beams=3, num_return_sequences=2, max_new_tokens=10, length_penalty=0.5, ignore_eos=True, gamma=0)
    r = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=10, n=2,
                                  extra_body={"use_beam_search": True, "best_of": 3, "length_penalty": 0.5, "ignore_eos": True, "return_token_ids": True})  # fmt: skip
    assert [extra(c, "token_ids") for c in r.choices] == [b.tokens for b in want.sequences]
    assert [c.text for c in r.choices] == [b.text for b in want.sequences] and [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 20 and r.choices[0].finish_reason == "length"
    # chat: width n, every beam returned
    msgs = [{"role": "user", "content": "hi"}]
    c = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, n=2, temperature=0, extra_body={"use_beam_search": True, "return_token_ids": True})
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(chat_bundle[0]).apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    ref = dec.beam_search(prompt, num_beams=2, num_return_sequences=2, max_new_tokens=8, gamma=0)
    assert [extra(ch, "token_ids") for ch in c.choices] == [b.tokens for b in ref.sequences]


def test_browser_safety_json_only_cors_opt_in_and_version(server, small_server):
    """A POST not declared application/json gets 415 (a web page can send text/plain or a form
    to localhost without a preflight); CORS headers only for the origins named by
    --allowed-origins (none on a server without it); /version."""
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2})
    auth = {"Authorization": f"Bearer {KEY}"}
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        r = httpx.post(server.url + "/v1/completions", content=body, headers={**auth, **({"Content-Type": kind} if kind else {})}, timeout=30)
        check_error(r, 415, "application/json")
    r = httpx.post(server.url + "/v1/completions", content=body, headers={**auth, "Content-Type": "application/json; charset=utf-8"}, timeout=30)
    assert r.status_code == 200, r.text
    preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    r = httpx.options(server.url + "/v1/completions", headers=preflight, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    r = httpx.options(server.url + "/v1/completions", headers={**preflight, "Origin": "http://evil.example"}, timeout=30)
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(small_server.url + "/health", headers={"Origin": "http://localhost:3000"}, timeout=30)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    from specdec import __version__

    assert httpx.get(server.url + "/version", timeout=30).json() == {"version": __version__}


def test_a_client_cache_salt_without_tenants(small_server):
    """Without --isolate-tenants the client's cache_salt is its own class ("request"): the same salt
    hits, another salt does not, and no salt is a class of its own (one slot, as the server has)."""
    c = openai.OpenAI(base_url=small_server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    prompt = [int(t) for t in np.random.default_rng(12).integers(3, 200, 60)]

    def hits(salt) -> dict:
        before = metrics(small_server.url)
        c.completions.create(model=None, prompt=prompt, max_tokens=2, temperature=0, extra_body={"cache_salt": salt} if salt else {})
        after = metrics(small_server.url)
        return {k: after[f"specdec_prefix_cache_hits_by_salt_class_total{{salt_class={k}}}"] - before[f"specdec_prefix_cache_hits_by_salt_class_total{{salt_class={k}}}"]
                for k in ("none", "request")}  # fmt: skip

    kept = len(prompt) - 1  # one slot: each request finds what the one before it left
    assert hits("a") == {"none": 0, "request": 0} and hits("a") == {"none": 0, "request": kept}
    assert hits("b") == {"none": 0, "request": 0} and hits(None) == {"none": 0, "request": 0}
    assert hits(None) == {"none": kept, "request": 0}


def test_processed_logprobs_mode(small_server):
    """--logprobs-mode processed_logprobs: the distribution sampled, so at top_k=1 every token's
    logprob is 0 and its alternatives past the first are excluded (-9999.0, vLLM's -inf)."""
    c = openai.OpenAI(base_url=small_server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    r = c.completions.create(model="small", prompt=[5, 6, 7], max_tokens=6, temperature=1.0, logprobs=2, extra_body={"top_k": 1, "ignore_eos": True})
    lps = r.choices[0].logprobs
    assert lps.token_logprobs == [0.0] * 6
    assert all(0.0 in top.values() and set(top.values()) <= {0.0, -9999.0} for top in lps.top_logprobs)  # two ids may share a string


# -- bad input -----------------------------------------------------------------------------------

BAD = [  # (body or raw text, status, the field the message must name)
    ({"model": "tiny", "prompt": "x", "use_beam_search": True, "temperature": 0.7}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "use_beam_search": True, "top_p": 0.9}, 400, "top_p"),
    ({"model": "tiny", "prompt": "x", "use_beam_search": True, "stop": ["\n"]}, 400, "stop"),
    ({"model": "tiny", "prompt": "x", "use_beam_search": True, "n": 40}, 400, "num_beams=40"),
    ({"model": "tiny", "prompt": "x", "use_beam_search": True, "length_penalty": "big"}, 400, "length_penalty"),
    ({"model": "tiny", "prompt": "x", "length_penalty": 2.0}, 400, "use_beam_search"),
    ({"model": "tiny", "prompt": "x", "early_stopping": "never"}, 400, "use_beam_search"),
    ({"model": "tiny", "prompt": "x", "use_beam_search": True, "early_stopping": "sometimes"}, 400, "early_stopping"),
    ("{not json", 400, "JSON"),
    ([1, 2], 400, "object"),
    ({"model": 5, "prompt": "x"}, 400, "model"),
    ({"model": "tiny"}, 400, "prompt"),
    ({"model": "nope", "prompt": "x"}, 404, "nope"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"model": "tiny", "prompt": "x", "top_k": -3}, 400, "top_k"),
    ({"model": "tiny", "prompt": "x", "seed": 2**63}, 400, "seed"),
    ({"model": "tiny", "prompt": [1, 2, 99999]}, 400, "99999"),
    ({"model": "tiny", "prompt": [1, "a"]}, 400, "prompt"),
    ({"model": "tiny", "prompt": []}, 400, "empty"),
    ({"model": "tiny", "prompt": ["a"] * 33, "n": 2}, 400, "66 choices"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 600}, 400, "max-seq-len"),
    ({"model": "tiny", "prompt": "x", "n": 0}, 400, "n=0"),
    ({"model": "tiny", "prompt": "x", "response_format": {"type": "json_schema"}}, 400, "json_schema.schema"),
    ({"model": "tiny", "prompt": "x", "best_of": 1, "n": 2}, 400, "best_of=1 is less than n=2"),
    ({"model": "tiny", "prompt": "x", "best_of": 3, "stream": True}, 400, "best_of=3 with stream"),
    ({"model": "tiny", "prompt": ["a"] * 20, "best_of": 4}, 400, "80 rows"),
    ({"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"99999": 1}}, 400, "99999"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias key 'abc'"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias entry 5"),
    ({"model": "tiny", "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"model": "tiny", "prompt": "x", "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    ({"model": "tiny", "prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens=5"),
    ({"model": "tiny", "prompt": "x", "logprobs": 21}, 400, "logprobs=21"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "echo"),
    ({"model": "tiny", "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"model": "tiny", "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"model": "tiny", "prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ({"model": "tiny", "prompt": "x", "synthetic_acceptance": 0.9}, 400, "synthetic_acceptance"),  # benchmarks only
    ({"model": "tiny", "prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({"model": "tiny", "prompt": "x", "stream": "yes"}, 400, "stream"),
]
BAD_CHAT = [
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "use_beam_search": True, "stream": True}, 400, "stream"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "use_beam_search": True, "logprobs": True}, 400, "logprobs"),
    ({"model": "tiny", "messages": []}, 400, "messages"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ({"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": []}, 400, "tools"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "logprobs=true"),
    ({"model": "tiny", "messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]}, 400, "tool_calls"),
]


def check_error(r: httpx.Response, status: int, names: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert names in err["message"] and err["type"] and "Traceback" not in r.text and "\n" not in err["message"]


def test_bad_requests_get_4xx_error_bodies_and_disturb_nothing(server, reference):
    """Every bad request, sent while a long greedy stream is in flight, answers 4xx with an
    OpenAI error body; the stream's output is still exactly its greedy output."""
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    box = {}

    def long_stream():
        with httpx.stream("POST", server.url + "/v1/completions", headers=headers, timeout=120,
                          json={"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 300, "temperature": 0, "stream": True, "ignore_eos": True, "return_token_ids": True}) as r:  # fmt: skip
            box["ids"] = [t for line in r.iter_lines() if line.startswith("data: {") for t in json.loads(line[6:])["choices"][0].get("token_ids", [])]

    t = threading.Thread(target=long_stream)
    t.start()
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as c:
        for body, status, names in BAD:
            r = c.post("/v1/completions", content=body if isinstance(body, str) else json.dumps(body))
            check_error(r, status, names)
        for body, status, names in BAD_CHAT:
            check_error(c.post("/v1/chat/completions", json=body), status, names)
        check_error(c.post("/v1/completions", content=b" " * (9 << 20)), 413, "bytes")
        check_error(c.get("/v1/nothing"), 404, "/v1/nothing")
        check_error(c.get("/v1/completions"), 405, "GET")
    t.join(120)
    assert box["ids"] == reference(PROMPTS[2], 300, ignore_eos=True).tokens


def test_api_key_guards_every_route_but_health(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        check_error(httpx.get(server.url + "/v1/models", headers=headers), 401, "API key")
        check_error(httpx.get(server.url + "/metrics", headers=headers), 401, "API key")
        check_error(httpx.post(server.url + "/v1/completions", headers=headers, json={"model": "tiny", "prompt": "x"}), 401, "API key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    models = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0).models.list()
    assert [m.id for m in models.data] == ["tiny"]


# -- overload, disconnects, shutdown ----------------------------------------------------------------


@pytest.fixture(scope="module")
def small_server(slow_bundle, tmp_path_factory):
    """One row, one queue place, plain decoding of the slow bundle (~1 ms a token: requests
    overlap and a disconnect lands mid-request); the bundle has no chat template. Its logprobs
    are the processed distribution's (--logprobs-mode processed_logprobs)."""
    s = Server(slow_bundle, "--max-batch", "1", "--max-queue", "1", "--gamma", "0", "--served-model-name", "small", "--logprobs-mode", "processed_logprobs",
               log=tmp_path_factory.mktemp("logs") / "small.log")  # fmt: skip
    yield s
    s.close()


def test_full_queue_answers_503_at_once_and_recovers(small_server):
    body = {"model": "small", "prompt": [5, 6, 7], "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    before = metrics(small_server.url)

    async def main():
        async with httpx.AsyncClient(base_url=small_server.url, timeout=60) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(8)))

    t0 = time.monotonic()
    got = asyncio.run(main())
    codes = [r.status_code for r in got]
    # the row and the queue place take one or two of them (two when the engine admits the first
    # before the rest arrive); every other one is refused at once
    assert set(codes) <= {200, 503} and codes.count(503) >= 6 and codes.count(200) >= 1, codes
    for r in got:
        if r.status_code == 503:
            assert r.headers["Retry-After"] and "retry" in r.json()["error"]["message"]
        else:
            assert r.json()["usage"]["completion_tokens"] == 200
    assert time.monotonic() - t0 < 60
    after = metrics(small_server.url)
    assert after["specdec_requests_total{outcome=rejected}"] - before["specdec_requests_total{outcome=rejected}"] == codes.count(503)
    r = httpx.post(small_server.url + "/v1/completions", json=body, timeout=60)  # recovered
    assert r.status_code == 200


def test_chat_without_a_template_is_refused(small_server):
    r = httpx.post(small_server.url + "/v1/chat/completions", json={"model": "small", "messages": [{"role": "user", "content": "hi"}]})
    check_error(r, 400, "chat template")


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_frees_the_row(small_server, stream):
    """The client leaves a 480-token request (~0.6 s of decoding) after its first chunk, or, not
    streamed, after 0.1 s: the engine stops decoding it at once (far fewer than 480
    iterations, counted by the engine's own occupancy metric well after the request would have
    ended), and the only row takes the next request."""
    before = metrics(small_server.url)
    client = openai.OpenAI(base_url=small_server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    if stream:
        chunks = client.completions.create(model="small", prompt=[5, 6, 7], max_tokens=480, temperature=0, stream=True, extra_body={"ignore_eos": True})
        next(iter(chunks))
        chunks.close()  # the client goes away after its first chunk
    else:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
            httpx.post(small_server.url + "/v1/completions", json={"model": "small", "prompt": [5, 6, 7], "max_tokens": 480, "ignore_eos": True}, timeout=0.1)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = metrics(small_server.url)
        if m["specdec_requests_total{outcome=abort}"] > before["specdec_requests_total{outcome=abort}"]:
            break
        time.sleep(0.05)
    time.sleep(1.5)  # past the time the whole request would take
    m = metrics(small_server.url)
    assert m["specdec_requests_total{outcome=abort}"] - before["specdec_requests_total{outcome=abort}"] == 1
    assert m["specdec_num_requests_running"] == 0
    iterations = m["specdec_batch_occupancy_count"] - before["specdec_batch_occupancy_count"]
    assert 0 < iterations < 400, iterations  # gamma 0: one token per iteration; 480 if never cancelled
    r = client.completions.create(model="small", prompt=[5, 6, 7], max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 20  # the only row is free again


def test_sigterm_drains_requests_in_flight_then_exits_0(slow_bundle, tmp_path):
    s = Server(slow_bundle, "--max-batch", "1", "--gamma", "0", "--served-model-name", "small", log=tmp_path / "drain.log")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
        stream = client.completions.create(model="small", prompt=[5, 6, 7], max_tokens=480, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
        chunks = iter(stream)
        ids = list(extra(next(chunks).choices[0], "token_ids"))
        s.proc.send_signal(15)  # SIGTERM while the request is in flight
        deadline = time.monotonic() + 5  # uvicorn closes its socket at its next tick (0.1 s)
        while time.monotonic() < deadline:
            try:
                httpx.get(s.url + "/health", timeout=1)
                time.sleep(0.02)
            except httpx.TransportError:  # no longer accepting connections
                break
        else:
            pytest.fail("still accepting connections 5 s after SIGTERM")
        last = None
        for c in chunks:
            ids += extra(c.choices[0], "token_ids")
            last = c
        assert len(ids) == 480 and last.choices[0].finish_reason == "length"
        assert s.proc.wait(30) == 0
    finally:
        s.close()


# -- in-process pieces -----------------------------------------------------------------------------


def test_health_and_requests_wait_for_the_engine():
    """Before the engine is loaded and warmed: /health and requests answer 503 with Retry-After."""
    from fastapi.testclient import TestClient

    from specdec.serve.app import ServerState, build_app

    state = ServerState(model="m", max_seq_len=64, codec=None, chat=None, gamma=None)
    with TestClient(build_app(state)) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "loading" and r.headers["Retry-After"]
        check_error(c.post("/v1/completions", json={"model": "m", "prompt": [1]}), 503, "loading")
        state.failed = "no such file"
        assert c.get("/health").json()["status"] == "failed"


def test_only_loopback_without_a_key_is_quiet():
    from specdec.serve.server import security_warning

    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert security_warning(host, None) is None
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.org"):
        assert "without authentication" in security_warning(host, None) and security_warning(host, "k") is None


def test_stop_strings_hold_back_only_what_may_start_one():
    from specdec.serve.stops import StopStrings

    s = StopStrings(["END", "\n\n"])
    assert [s.push(d) for d in ["abc", "E", "N", "x hello\n", "\nmore"]] == ["a", "b", "c", "ENx hell", "o"] and s.hit
    assert s.flush() == ""
    s = StopStrings(["stop"])
    assert s.push("no st") + s.push("o") + s.push("p here") == "no " and s.hit
    s = StopStrings(["zz"])
    assert s.push("abc") + s.push("z") + s.flush() == "abcz" and not s.hit


def test_serve_cli_refuses_bad_options_in_one_line(llama_bundle, tmp_path):
    import socket

    bundle = str(llama_bundle[2])
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    cases = [
        ([bundle, "--port", str(taken.getsockname()[1])], "cannot bind"),
        ([bundle, "--host", "no-such-host.invalid"], "--host"),
        ([str(tmp_path / "nothing")], "not a folder"),
        ([bundle, "--gamma", "9"], "gamma=9"),
        ([bundle, "--gamma", "x"], "--gamma"),
        ([bundle, "--max-batch", "4"], "max_batch=4"),
        ([bundle, "--max-queue", "0"], "max_queue=0"),
        ([bundle, "--chat-template", str(tmp_path / "none.jinja")], "none.jinja"),
        ([bundle, "--port", "70000"], "--port"),
        ([bundle, "--cache-slots", "0"], "cache_slots=0"),
        ([bundle, "--isolate-tenants"], "--isolate-tenants"),
        ([bundle, "--api-key", ""], "--api-key ''"),
    ]
    for args, names in cases:
        r = subprocess.run([sys.executable, "-m", "specdec", "serve", *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (args, r.stderr)
        assert names in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    taken.close()


def test_chat_template_renders_as_transformers_does(chat_bundle):
    from transformers import AutoTokenizer

    from specdec.manifest import load_manifest
    from specdec.serve.server import ServeConfig, prepare

    m = load_manifest(chat_bundle[1])
    assert m.chat_template == "tokenizer/chat_template.jinja"
    state = prepare(ServeConfig(chat_bundle[1]))
    tok = AutoTokenizer.from_pretrained(chat_bundle[0])
    for messages in ([{"role": "user", "content": "hi"}], [{"role": "system", "content": "s"}, {"role": "user", "content": "a\nb"}, {"role": "assistant", "content": "c"}]):
        for gen in (True, False):
            assert state.chat.render(messages, gen) == tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
    assert np.array_equal(state.codec.encode(state.chat.render(messages, True), special=False), tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def test_null_fields_mean_their_defaults():
    """Some clients send null for unset fields: the defaults apply, and "off" fields stay off."""
    from specdec.runtime.params import SamplingParams
    from specdec.serve.protocol import CompletionRequest, FieldError
    from specdec.serve.validation import parse

    body = parse(CompletionRequest, {"model": "m", "prompt": "x", "temperature": None, "top_p": None, "n": None, "echo": None,
                                     "presence_penalty": None, "frequency_penalty": None, "repetition_penalty": None, "min_p": None,
                                     "logit_bias": None, "stream": None, "logprobs": None, "best_of": None})  # fmt: skip
    got = body.sampling()
    assert got["temperature"] == 1.0 and got["top_p"] is None and not body.stream and body.rows == 1
    assert SamplingParams(**got).penalties is None and got["min_p"] == 0.0
    with pytest.raises(FieldError, match="suffix"):
        parse(CompletionRequest, {"model": "m", "prompt": "x", "suffix": "y"})


def test_encoder_decoder_bundles_are_served(seq2seq_bundle, tmp_path):
    """T5, BART and Marian behind the server: 8 requests in flight, decoded several rows to a
    call by the bundle's rows graphs, each source's output the PyTorch target's greedy output
    token for token."""
    pytest.importorskip("torch")
    from models import load_seq2seq, seq2seq_greedy

    family, target, _, out, _ = seq2seq_bundle
    sources = [[5, 17, 42, 99, 7, 3, 250, 61, 1], [30, 31, 32, 33, 34, 30, 31, 32, 1], [200, 1], [7, 8, 9, 10, 1]] * 2
    sources = [s[: len(s) - i % 3] + ([1] if i % 3 else []) for i, s in enumerate(sources)]
    with Server(out, "--served-model-name", family, "--drafter", "hierarchical" if family == "t5" else "model", log=tmp_path / "server.log") as s:
        got = in_flight(s.url, family, sources, [24] * len(sources))
        m = metrics(s.url)
    assert m["specdec_batch_occupancy_bucket{le=1.0}"] < m["specdec_batch_occupancy_count"], "no iteration decoded two rows or more"
    model = load_seq2seq(target)
    for src, ids in zip(sources, got):
        assert ids == seq2seq_greedy(model, src, 24), f"{family} source {src}"


def test_the_hierarchical_drafter_is_served(chat_bundle, reference, tmp_path):
    """The hierarchical drafter runs in the batched engine: 8 in flight, each its greedy output."""
    with Server(chat_bundle[1], "--served-model-name", "tiny", "--drafter", "hierarchical", log=tmp_path / "server.log") as s:
        got = in_flight(s.url, "tiny", PROMPTS, [30] * len(PROMPTS))
    for prompt, ids in zip(PROMPTS, got):
        assert ids == reference(prompt, 30, ignore_eos=True).tokens, prompt


def test_more_choices_than_the_queue_holds_is_a_400_not_a_retry(client):
    """A request's choices are queued as one group (BatchEngine.submit_together); more than the
    queue ever holds (the server runs with --max-queue 16) can never be queued, so it is the
    request's fault: a 400 naming the bound, and the server goes on serving."""
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2, n=17)
    assert "17 requests in one group exceed the queue's 16" in e.value.message
    assert len(client.completions.create(model="tiny", prompt="Hi", max_tokens=2, n=16).choices) == 16

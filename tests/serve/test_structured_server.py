"""Structured outputs behind ``specdec serve``: OpenAI's ``response_format`` and vLLM's
``structured_outputs``, through the official ``openai`` client and raw HTTP. Served greedy
tokens equal the single-request decoder's under the same constraint; every output validates."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import KEY

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "size": {"type": "integer", "minimum": 0, "maximum": 99},
                   "kind": {"enum": ["stack", "queue"]}},
    "required": ["name", "size", "kind"],
    "additionalProperties": False,
}  # fmt: skip
MESSAGES = [{"role": "user", "content": "Describe a stack as JSON."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def decoder(chat_bundle):
    from specdec.runtime.decoder import SpeculativeDecoder

    return SpeculativeDecoder.load(chat_bundle[1])


def extra(obj, name):
    return (obj.model_extra or {})[name]


def test_json_schema_response_format_is_the_constrained_target_streamed_or_not(client, decoder):
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=80, temperature=0, response_format=fmt,
                                       extra_body={"return_token_ids": True})  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    ref = decoder.generate(extra(r, "prompt_token_ids"), max_new_tokens=80, structured_outputs={"json": SCHEMA})
    assert extra(choice, "token_ids") == ref.tokens
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=80, temperature=0, response_format=fmt, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == choice.message.content and len(pieces) > 2


def test_json_object_regex_choice_and_sampled_choices_all_validate(client, decoder):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # the tiny model may write an object past max_tokens; what it wrote is still the object's start
        assert r.choices[0].message.content.startswith("{")
    r = client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=20, temperature=0,
                                  extra_body={"structured_outputs": {"regex": "[a-z]{2,5}-[0-9]{2}"}, "return_token_ids": True})  # fmt: skip
    text = r.choices[0].text
    assert r.choices[0].finish_reason == "stop" and len(text.split("-")) == 2 and text.split("-")[1].isdigit(), text
    ref = decoder.generate(extra(r, "prompt_token_ids"), max_new_tokens=20, structured_outputs={"regex": "[a-z]{2,5}-[0-9]{2}"})
    assert extra(r.choices[0], "token_ids") == ref.tokens
    choices = ["push", "pop", "peek"]
    r = client.completions.create(model="tiny", prompt="class Stack:\n", max_tokens=10, temperature=1.0, seed=3, n=6,
                                  extra_body={"structured_outputs": {"choice": choices}})  # fmt: skip
    assert len(r.choices) == 6 and all(c.text in choices and c.finish_reason == "stop" for c in r.choices)
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=80, temperature=1.0, seed=5, n=4,
                                       response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}})  # fmt: skip
    for c in r.choices:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_the_older_constraint_fields_clients_still_send(client, decoder):
    """vLLM's guided_* fields and llama.cpp's server's json_schema / grammar / response_format
    schema hold the output as structured_outputs does, token for token."""
    choices, regex, gbnf = ["push", "pop"], "[a-z]{2,5}-[0-9]{2}", 'root ::= "n" [0-9] [0-9]?'
    cases = [({"guided_choice": choices}, {"choice": choices}), ({"guided_regex": regex}, {"regex": regex}),
             ({"guided_json": SCHEMA}, {"json": SCHEMA}), ({"json_schema": SCHEMA}, {"json": SCHEMA}), ({"grammar": gbnf}, {"grammar": gbnf}),
             ({"response_format": {"type": "json_object", "schema": SCHEMA}}, {"json": SCHEMA})]  # fmt: skip
    for body, spec in cases:
        r = client.completions.create(model="tiny", prompt="class Stack:\n", max_tokens=60, temperature=0, extra_body={**body, "return_token_ids": True})
        ref = decoder.generate(extra(r, "prompt_token_ids"), max_new_tokens=60, structured_outputs=spec)
        assert extra(r.choices[0], "token_ids") == ref.tokens, body


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}, "response_format", "json"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "json_schema.schema"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs", "send one"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"whitespace": "x"}}, "structured_outputs", "not a field"),
        ({"structured_outputs": {"grammar": "start: nothing_defined"}}, "structured_outputs", "grammar"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "send one"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, None, "ignore_eos"),
        ({"response_format": {"type": "json_object"}, "use_beam_search": True, "n": 2, "temperature": 0}, "response_format", "beam"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(server, client, body, param, words):
    r = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"model": "tiny", "messages": MESSAGES, "max_tokens": 5, **body})  # fmt: skip
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and "\n" not in err["message"], err
    if param:
        assert err["param"] == param, err
    ok = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0)  # the server still serves
    assert ok.choices[0].message.content is not None


# -- tool calls --------------------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                                                      "unit": {"enum": ["c", "f"]}},
                                                     "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "maximum": 999},
                                                                                                      "b": {"type": "integer", "maximum": 999}},
                                                                  "required": ["a", "b"], "additionalProperties": False}}},
]  # fmt: skip
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def test_named_and_required_tool_calls_are_held_to_their_schemas(client, decoder):
    named = {"type": "function", "function": {"name": "add"}}
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0, tools=TOOLS, tool_choice=named,
                                       extra_body={"return_token_ids": True})  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    (tc,) = c.message.tool_calls
    assert tc.type == "function" and tc.function.name == "add" and tc.id.startswith("call_")
    jsonschema.validate(json.loads(tc.function.arguments), PARAMS["add"])
    ref = decoder.generate(extra(r, "prompt_token_ids"), max_new_tokens=60, structured_outputs={"json": PARAMS["add"]})
    assert extra(c, "token_ids") == ref.tokens and ref.text == tc.function.arguments
    for parallel in (False, True):
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=120, temperature=1.0, seed=7, n=3, tools=TOOLS,
                                           tool_choice="required", parallel_tool_calls=parallel)  # fmt: skip
        for c in r.choices:
            if c.finish_reason == "length":  # a tiny model may run out inside a call: its text is returned as content
                assert c.message.content.startswith("[")
                continue
            assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
            assert parallel or len(c.message.tool_calls) == 1
            for tc in c.message.tool_calls:
                jsonschema.validate(json.loads(tc.function.arguments), PARAMS[tc.function.name])


def test_a_streamed_tool_call_and_the_conversation_sent_back(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0, tools=TOOLS, tool_choice=named)
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0, tools=TOOLS, tool_choice=named,
                                            stream=True, stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert [(tc.function.name, tc.function.arguments) for tc in calls] == [(t.function.name, t.function.arguments) for t in whole.choices[0].message.tool_calls]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls" and chunks[-1].usage.completion_tokens > 0
    call = whole.choices[0].message.tool_calls[0]
    convo = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21"}]  # fmt: skip
    small = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]  # the tiny tokenizer spends ~4 tokens a word
    r = client.chat.completions.create(model="tiny", messages=convo, max_tokens=10, temperature=0, tools=small)  # auto: the model answers
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content is not None


def test_auto_tool_calls_are_parsed_from_what_the_model_wrote():
    from specdec.serve.tools import ToolPlan

    auto = ToolPlan("auto", tuple(TOOLS))
    msg, finish = auto.message('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>', "stop")
    assert finish == "tool_calls" and msg["content"] == "I will check." and json.loads(msg["tool_calls"][0]["function"]["arguments"])["city"] == "Oslo"
    msg, finish = auto.message('[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}]', "stop")
    assert finish == "tool_calls" and [json.loads(c["function"]["arguments"])["a"] for c in msg["tool_calls"]] == [1, 3]
    for text in ('{"name": "unknown_fn", "arguments": {}}', "Just text.", '<tool_call>{"name": "add", "arguments": 5}</tool_call>'):
        msg, finish = auto.message(text, "stop")
        assert finish == "stop" and msg["content"] == text and "tool_calls" not in msg
    msg, finish = auto.message('<tool_call>{"name": "add", "arguments": {"a": 1', "length")  # cut by max_tokens: content
    assert finish == "length" and "tool_calls" not in msg


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "drop response_format"),
        ({"tools": TOOLS + TOOLS[:1]}, "unique"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}], "tool_choice": "required"}, "json"),
    ],
)
def test_bad_tool_requests_are_400(server, body, words):
    r = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"model": "tiny", "messages": MESSAGES, "max_tokens": 5, **body})  # fmt: skip
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"], r.json()


def test_a_template_without_tools_gets_them_in_the_system_message():
    """SmolLM2's template (and the test models') renders no ``tools``: the functions are described
    in the system message, in the format auto calls are parsed from; a template that renders
    ``tools`` itself gets the messages unchanged."""
    from models import CHAT_TEMPLATE

    from specdec.serve.chat import ChatTemplate
    from specdec.serve.tools import ToolPlan, with_tools

    auto = ToolPlan("auto", tuple(TOOLS))
    chat = ChatTemplate(CHAT_TEMPLATE, "<s>", "</s>", "test")
    for messages in (MESSAGES, [{"role": "system", "content": "Be brief."}, *MESSAGES]):
        text = chat.render(with_tools(messages, auto, CHAT_TEMPLATE), tools=list(auto.tools))
        assert '"name": "get_weather"' in text and "<tool_call>" in text and text.count("system") == 1
        assert "Describe a stack" in text and (messages is MESSAGES or "Be brief." in text)
    native = "{% for t in tools %}{{ t.function.name }}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert with_tools(MESSAGES, auto, native) == MESSAGES
    assert ChatTemplate(native, "", "", "native").render(MESSAGES, tools=list(auto.tools)).startswith("get_weatheradd")

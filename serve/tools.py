"""Tool calls in the chat API: OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``.

    plan(body) -> ToolPlan | None          what the request asks (None: no tools in play)
    ToolPlan.constraint                    "required" / a named function: the output is held to
                                           JSON of the calls (runtime/constraints.py), exactly
    ToolPlan.message(text, finish)         the model's text as OpenAI's assistant message:
                                           ``tool_calls`` (finish "tool_calls") or ``content``
    template_messages(messages)            messages as chat templates take them (tool calls'
                                           arguments as objects, tool results with their ids)
    with_tools(messages, plan, template)   the functions described in the system message for
                                           a template that renders no tools of its own

As vLLM does it: ``tool_choice="required"`` holds the output to a JSON array of
``{"name", "arguments"}`` objects, one per call (at most one without ``parallel_tool_calls``),
each ``arguments`` to its function's ``parameters`` schema; a named function holds it to that
function's arguments object. With ``"auto"`` the model decides, in the format its chat template
taught it: ``<tool_call>{...}</tool_call>`` blocks (Hermes, Qwen, SmolLM3) or a bare JSON call;
its output is parsed, not constrained. ``"none"`` renders no tools and parses nothing.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from specdec.runtime.constraints import StructuredOutputs

HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "auto", "required" or "named"
    tools: tuple[dict, ...]  # OpenAI's tool objects, as the chat template takes them
    name: str | None = None  # the named function
    parallel: bool = True

    @property
    def functions(self) -> dict[str, dict]:
        return {t["function"]["name"]: t["function"] for t in self.tools}

    @property
    def constraint(self) -> StructuredOutputs | None:
        if self.mode == "named":
            return StructuredOutputs(json=self.functions[self.name].get("parameters") or {"type": "object"})
        if self.mode != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": fn.get("parameters") or {"type": "object"}},
                  "required": ["name", "arguments"], "additionalProperties": False} for name, fn in self.functions.items()]  # fmt: skip
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return StructuredOutputs(json={**schema, "maxItems": 1} if not self.parallel else schema)

    def calls(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of the model's ``text``; no calls when it made none."""
        if self.mode == "named":
            return None, [call(self.name, text)]
        if self.mode == "required":
            return None, [call(c["name"], c["arguments"]) for c in loads(text) or []]
        return parse_auto(text, set(self.functions))

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """The assistant message for ``text`` and its finish_reason ("tool_calls" when it called
        tools and ended on its own; an output cut by max_tokens stays "length", as content)."""
        if finish == "stop":
            content, calls = self.calls(text)
            if calls:
                return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
        return {"role": "assistant", "content": text}, finish


def call(name: str, arguments) -> dict:
    """One OpenAI tool call; ``arguments`` as the JSON text a client parses."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse_auto(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """Tool calls the model wrote on its own: ``<tool_call>`` blocks (the text before the first
    is the content), else the whole output as one JSON call or a list of them. A call must name
    a known function and carry an object of arguments (``arguments`` or ``parameters``)."""

    def as_call(obj) -> dict | None:
        if not isinstance(obj, dict) or obj.get("name") not in names:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        args = loads(args) if isinstance(args, str) else args
        return call(obj["name"], args) if isinstance(args, dict) else None

    blocks = HERMES.findall(text)
    if blocks:
        calls = [as_call(loads(b)) for b in blocks]
        if calls and all(calls):
            head = text[: text.index("<tool_call>")].strip()
            return head or None, calls
        return text, []
    obj = loads(text.strip())
    found = [as_call(o) for o in (obj if isinstance(obj, list) else [obj])] if obj is not None else []
    if found and all(found):
        return None, found
    return text, []


def plan(body) -> ToolPlan | None:
    """The request's tool plan; None without tools or with ``tool_choice="none"``."""
    tools = getattr(body, "tools", None)
    choice = getattr(body, "tool_choice", None)
    if not tools or choice == "none":
        return None
    dumped = tuple(t.model_dump(exclude_none=True) for t in tools)
    parallel = body.parallel_tool_calls is not False
    if choice is None or choice == "auto":
        return ToolPlan("auto", dumped, parallel=parallel)
    if choice == "required":
        return ToolPlan("required", dumped, parallel=parallel)
    return ToolPlan("named", dumped, choice.function.name, parallel)


def template_messages(messages) -> list[dict]:
    """The conversation as chat templates take it (transformers' convention): an assistant's
    tool calls with their arguments as objects, a tool result with its ``tool_call_id``."""
    out = []
    for m in messages:
        d = {"role": m.role, "content": m.text()}
        if m.name:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": loads(c.function.arguments) or {}}} for c in m.tool_calls]  # fmt: skip
        out.append(d)
    return out


TOOLS_PROMPT = ("You can call these functions:\n{tools}\n\nTo call one, reply with <tool_call>{{\"name\": <its name>, \"arguments\": "
                "<an object of its arguments>}}</tool_call>, one block per call; otherwise answer in plain text.")


def with_tools(messages: list[dict], plan: ToolPlan, template_source: str) -> list[dict]:
    """``messages`` for a chat template that renders no ``tools`` of its own (SmolLM2's, and most
    base models'): the functions described in the system message, in the ``<tool_call>`` format
    ``parse_auto`` reads, as llama.cpp's server does for such templates. A template that uses
    ``tools`` gets the messages as they are. (For "auto" only: a required or named call is
    held to its schema whatever the prompt says.)"""
    if "tools" in template_source:
        return messages
    text = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t["function"], ensure_ascii=False) for t in plan.tools))
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def stream_chunks(out: dict, include_usage: bool) -> list[dict]:
    """A finished chat completion as the chunks of a stream: per choice, its whole message in
    one delta and then its finish_reason; the usage chunk when asked. The response's
    ``metrics`` (where the server reports them) ride on the last chunk, as in a decoded stream."""
    head = {k: out[k] for k in ("id", "created", "model", "system_fingerprint")} | {"object": "chat.completion.chunk"}
    chunks = []
    for c in out["choices"]:
        msg = c["message"]
        delta = {"role": "assistant", "content": msg.get("content")}
        if msg.get("tool_calls"):
            delta["tool_calls"] = [{"index": k, **tc} for k, tc in enumerate(msg["tool_calls"])]
        chunks.append({**head, "choices": [{"index": c["index"], "delta": delta, "logprobs": c.get("logprobs"), "finish_reason": None}]})
        chunks.append({**head, "choices": [{"index": c["index"], "delta": {}, "logprobs": None, "finish_reason": c["finish_reason"]}]})
    if include_usage:
        chunks.append({**head, "choices": [], "usage": out["usage"]})
    if "metrics" in out:
        chunks[-1]["metrics"] = out["metrics"]
    return chunks

"""A request body checked: pydantic's first error as a ``FieldError`` naming the field, then the
checks across fields (values only "off" is accepted at, tools, logprobs, choices, beam search).
The request models themselves, the wire format, are in serve/protocol.py.
"""

from __future__ import annotations

import types
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from specdec.runtime.logprobs import MAX_LOGPROBS
from specdec.serve.protocol import (
    ALIASES,
    BOUNDS,
    MAX_CHOICES,
    RESERVED_TEMPLATE_NAMES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    FieldError,
    NamedToolChoice,
    TokenizeRequest,
    is_list_of_prompts,
)

# field -> (values that mean "off", what to do instead)
_OFF = {
    "suffix": ((None,), "insertion is not supported"),
}
SEED_RANGE = (-(2**63), 2**63 - 1)  # vLLM's: a 64-bit signed integer
# message field -> (values that mean "empty", why anything else is refused)
_MESSAGE_OFF = {
    "refusal": ((None, ""), "a refusal is the model's own output; send it as content"),
    "function_call": ((None,), "function calls are not supported"),
    "audio": ((None,), "audio is not supported"),
    "annotations": ((None, []), "annotations are not supported"),
}
_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none"}


def _where(loc: tuple) -> str:
    """A pydantic error location as a field path ("messages.0.content"), without the names of
    union members pydantic puts in it."""
    keep = [str(p) for p in loc if isinstance(p, int) or not ("[" in p or p[:1].isupper() or p.lower() in _TYPE_NAMES or p.startswith("constrained-"))]
    return ".".join(keep)


def parse(cls: type[BaseModel], raw: Any) -> BaseModel:
    """``raw`` (decoded JSON) as a ``cls``; an ``InputError`` names the first bad field."""
    body = _validated(cls, raw)
    _check_off(body)
    if isinstance(body, TokenizeRequest) and (body.prompt is None) == (body.messages is None):
        raise FieldError("send either prompt or messages to tokenize", "prompt")
    if isinstance(body, (TokenizeRequest, DetokenizeRequest)):
        return body
    if isinstance(body, ChatCompletionRequest):
        _check_tools(body)
    body.structured()  # a bad constraint is refused here, naming its field (its grammar is compiled on admission)
    _check_choices(body)
    _check_beam_fields(body)
    clash = sorted(set(getattr(body, "chat_template_kwargs", None) or ()) & set(RESERVED_TEMPLATE_NAMES))
    if clash:
        raise FieldError(f"chat_template_kwargs: {clash} are set by the request itself; rename or remove them", "chat_template_kwargs")
    return body


def _validated(cls: type[BaseModel], raw: Any) -> BaseModel:
    """``raw`` as a ``cls`` by pydantic; its first error as a ``FieldError`` naming the field."""
    if not isinstance(raw, dict):
        raise FieldError(f"request body is JSON {type(raw).__name__}; expected an object")
    try:
        return cls.model_validate(raw)
    except ValidationError as e:
        errors = e.errors()
        _refuse_too_long(errors)
        err = errors[0]
        field = _where(err["loc"])
        if err["type"] == "extra_forbidden":
            raise FieldError(f"{field}: unsupported field; specdec does not implement it, remove it from the request", field) from None
        if err["type"] == "missing":
            raise FieldError(f"{field} is required", field) from None
        if sum(x["loc"][:1] == err["loc"][:1] for x in e.errors()) > 1 and len(err["loc"]) > 1:  # a union: no member fits
            top = str(err["loc"][0])
            kind = _type_name(getattr(cls.model_fields.get(top), "annotation", "?"))
            raise FieldError(f"{top}={str(raw.get(top))[:60]!r}: expected {kind}", top) from None
        raise FieldError(f"{field}={str(err.get('input'))[:60]!r}: {err['msg'].lower()}", field) from None


def _check_off(body: BaseModel) -> None:
    """Fields accepted only at their "off" values (``_OFF``; a message's, ``_MESSAGE_OFF``)."""
    for name, (off, instead) in _OFF.items():
        value = getattr(body, name, None)
        if name in type(body).model_fields and value not in off:
            raise FieldError(f"{name}={value!r} is not supported (only {off[0]!r}): {instead}", name)
    for i, m in enumerate(getattr(body, "messages", None) or ()):
        for name, (off, why) in _MESSAGE_OFF.items():
            if getattr(m, name) not in off:
                raise FieldError(f"messages.{i}.{name}={str(getattr(m, name))[:60]!r}: {why}", f"messages.{i}.{name}")


def _check_choices(body: CompletionRequest | ChatCompletionRequest) -> None:
    """Logprobs, choices (``n``, ``best_of``), streaming, the seed and the rows one request asks for."""
    top = body.logprobs if isinstance(body, CompletionRequest) else body.top_logprobs
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        name = "logprobs" if isinstance(body, CompletionRequest) else "top_logprobs"
        raise FieldError(f"{name}={top}: expected 0..{MAX_LOGPROBS} alternatives per token", name)
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs and not body.logprobs:
        raise FieldError(f"top_logprobs={body.top_logprobs} needs logprobs=true", "top_logprobs")
    if isinstance(body, CompletionRequest) and body.max_tokens == 0 and not body.echo:
        raise FieldError("max_tokens=0 returns nothing without echo=true; ask for 1 or more tokens, or echo the prompt", "max_tokens")
    if body.n is not None and body.n < 1:
        raise FieldError(f"n={body.n}: expected an integer >= 1 (choices per prompt)", "n")
    best_of = getattr(body, "best_of", None)
    if best_of is not None and best_of < body.choices:
        raise FieldError(f"best_of={best_of} is less than n={body.choices}: best_of rows are decoded and the best n returned; "
                         "ask for best_of >= n", "best_of")  # fmt: skip
    if best_of is not None and best_of > body.choices and body.stream:
        raise FieldError(f"best_of={best_of} with stream=true: the best choices are known only at the end; stream without best_of", "best_of")
    if body.stream_options is not None and not body.stream:
        raise FieldError("stream_options is only allowed with stream=true", "stream_options")
    if body.seed is not None and not SEED_RANGE[0] <= body.seed <= SEED_RANGE[1]:
        raise FieldError(f"seed={body.seed}: expected a 64-bit signed integer [{SEED_RANGE[0]}, {SEED_RANGE[1]}]", "seed")
    prompts = len(body.prompt) if isinstance(body, CompletionRequest) and is_list_of_prompts(body.prompt) else 1
    if prompts * body.rows > MAX_CHOICES:
        what = f"best_of={body.rows}" if best_of else f"n={body.choices}"
        raise FieldError(f"{prompts} prompt(s) x {what} = {prompts * body.rows} {'rows' if best_of else 'choices'}; the limit is {MAX_CHOICES}: "
                         "split the request", "best_of" if best_of else "n")  # fmt: skip


def _check_tools(body: ChatCompletionRequest) -> None:
    names = [t.function.name for t in body.tools or ()]
    if len(set(names)) < len(names):
        raise FieldError(f"tools: function names must be unique; {sorted(n for n in set(names) if names.count(n) > 1)} appear twice", "tools")
    choice = body.tool_choice
    if choice not in (None, "none", "auto") and not names:
        raise FieldError(f"tool_choice={choice if isinstance(choice, str) else 'a named function'!r} needs tools; send the functions in tools", "tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise FieldError(f"tool_choice names function {choice.function.name!r}, which is not in tools ({', '.join(names)})", "tool_choice")
    if body.tools and body.use_beam_search:
        raise FieldError("tools with use_beam_search: beam search has no tool calls; drop one of them", "tools")


# Fields beam search does not use, and their "off" values: a beam request setting one gets a 400.
BEAM_OFF = {"stream": (False, None), "logprobs": (None, False), "top_logprobs": (None,), "echo": (False, None), "top_p": (1.0, None),
            "top_k": (None, 0, -1), "min_p": (0.0, None), "min_tokens": (0, None), "presence_penalty": (0.0, None),
            "frequency_penalty": (0.0, None), "repetition_penalty": (1.0, None), "logit_bias": (None,), "stop": (None, []),
            "structured_outputs": (None,), **{name: (None,) for name in ALIASES}}  # fmt: skip


def _check_beam_fields(body) -> None:
    """Beam search's own fields only with it; with it, no field it would ignore."""
    if not body.use_beam_search:
        for name, off in (("length_penalty", (1.0, None)), ("early_stopping", (False, None))):
            if getattr(body, name) not in off:
                raise FieldError(f"{name}={getattr(body, name)!r} applies to beam search only; add use_beam_search=true or drop it", name)
        return
    for name, off in BEAM_OFF.items():
        if hasattr(body, name) and getattr(body, name) not in off:
            why = "stream=false: beam search returns its beams when it ends" if name == "stream" else "drop it (beam search ranks by the model's own log-probs)"
            raise FieldError(f"{name}={str(getattr(body, name))[:60]!r} is not supported with use_beam_search; {why}", name)
    if body.response_format is not None and body.response_format.type != "text":
        raise FieldError(f"response_format type {body.response_format.type!r} is not supported with use_beam_search; "
                         "drop one of them (beam search has no constrained decoding)", "response_format")  # fmt: skip
    if body.temperature not in (None, 0.0, 1.0):
        raise FieldError(f"temperature={body.temperature}: beam search is deterministic and scores the model's own distribution; "
                         "send 0, 1 or none with use_beam_search", "temperature")  # fmt: skip
    if body.length_penalty is not None and not abs(body.length_penalty) < float("inf"):
        raise FieldError(f"length_penalty={body.length_penalty}: expected a finite number", "length_penalty")


def _refuse_too_long(errors: list[dict]) -> None:
    """A ``FieldError`` naming the field and its bound when a list or string is over its bound
    (of a union's members, the one with the largest bound: prompt ids rather than prompt lists)."""
    long = [x for x in errors if x["type"] in ("too_long", "string_too_long")]
    if not long:
        return
    err = max(long, key=lambda x: x["ctx"]["max_length"])
    field, bound = _where(err["loc"]), err["ctx"]["max_length"]
    have = err["ctx"].get("actual_length", len(err["input"]) if hasattr(err["input"], "__len__") else "?")
    unit = "characters" if err["type"] == "string_too_long" else "entries"
    name = [p for p in field.split(".") if not p.isdigit()][-1]
    why = next((w for k, (b, w) in BOUNDS.items() if k.split()[0] == name and b == bound), "")
    raise FieldError(f"{field}: {have} {unit}; the limit is {bound}" + (f" ({why})" if why else ""), field.split(".")[0])


def _type_name(t: Any) -> str:
    """A field's type as a client reads it: "str | list[str] | None" (bounds left out)."""
    origin, args = get_origin(t), get_args(t)
    if origin is Annotated:
        return _type_name(args[0])
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return "None" if t is type(None) else getattr(t, "__name__", str(t))

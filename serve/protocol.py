"""The OpenAI wire format the server accepts: request bodies checked strictly, refused with the field named.

Fields follow OpenAI's completions and chat completions APIs, with vLLM's extension fields
(``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``,
``return_token_ids``). A field the server does not implement is refused (400 naming it) rather
than silently ignored, unless its value is the one that means "off" (``suffix=null``), which
clients often send explicitly.

Every list field has a bound (``BOUNDS``; a 400 names the field and the bound beyond it), so the
work one request asks of validation and decoding is capped; the body limits (bytes, nesting) are
in serve/limits.py. A request asks for prompts x ``n`` choices, at most ``MAX_CHOICES``.

Fields clients send back unchanged are accepted at their empty values: an assistant message's
null ``refusal``, ``tool_calls``, ``function_call``, ``audio`` and ``annotations`` (as the openai
library dumps it), and no ``model`` (the served one).

Structured outputs: OpenAI's ``response_format`` (``json_object``, ``json_schema``) or vLLM's
``structured_outputs`` (json, regex, choice, grammar, json_object), checked here and compiled
when the request is admitted (runtime/constraints.py); a bad one is a 400 naming the field.
"""

from __future__ import annotations

import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specdec.errors import InputError
from specdec.runtime.constraints import StructuredOutputs
from specdec.runtime.logprobs import MAX_LOGPROBS


class FieldError(InputError):
    """A request field is wrong; ``param`` names it (OpenAI's error body carries it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# field -> (bound, why). pydantic checks a list's length before its items, so a long list costs nothing.
BOUNDS = {
    "stop": (16, "OpenAI allows 4 and vLLM any number; every stop string is matched against each streamed piece, and 16 holds any chat format's set"),
    "stop string": (512, "characters of one stop string; a stream holds back as many characters as its longest stop string has"),
    "stop_token_ids": (64, "a model's end tokens are a handful; each accepted token is looked up in them"),
    "logit_bias": (300, "entries, as OpenAI's bound"),
    "prompt ids": (1 << 17, "token ids; 128K, the longest context of current models"),
    "prompt list": (64, "prompts in a list; with n, at most MAX_CHOICES choices in all"),
    "messages": (1024, "messages in a chat; the whole conversation must fit the context"),
    "content": (256, "text parts of one message"),
    "chat_template_kwargs": (32, "extra template variables"),
    "tools": (128, "functions offered to the model; each one's schema is rendered into the prompt and compiled for required calls"),
    "tool_calls": (128, "calls in one assistant message sent back"),
}
_LEN = {kind: Field(max_length=bound) for kind, (bound, _) in BOUNDS.items()}
MAX_CHOICES = 64  # prompts x n in one request: each choice is a row of the batched engine (the rest queue)
_Stop = Annotated[str, _LEN["stop string"]]
_Ids = Annotated[list[int], _LEN["prompt ids"]]
# Names the chat template gets from the request itself; chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_NAMES = ("messages", "add_generation_prompt", "bos_token", "eos_token")


class _Body(BaseModel):
    # strict: "5" is not an int and true is not a number; extra: an unknown field is an error
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class JsonSchemaFormat(_Body):
    """OpenAI's ``response_format.json_schema``: the output is held to ``schema`` whether or not
    ``strict`` is set (constrained decoding makes every output valid)."""

    name: str = Field(max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # llama.cpp's server: json_object with a schema


class _Sampling(_Body):
    model: str | None = None  # None: the served model, as vLLM and llama-server take it
    max_tokens: int | None = None
    temperature: float | None = 1.0  # OpenAI's default: sampled; null (as some clients send) means the default
    top_p: float | None = 1.0
    top_k: int | None = None  # vLLM: -1 or 0 turn it off
    seed: int | None = None
    stop: _Stop | Annotated[list[_Stop], _LEN["stop"]] | None = None
    stop_token_ids: Annotated[list[int], _LEN["stop_token_ids"]] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    user: str | None = None  # metadata; not used
    n: int | None = 1  # choices per prompt; choice j of a seeded request draws from seed + j
    response_format: ResponseFormat | None = None  # text, json_object or json_schema (constrained decoding)
    structured_outputs: dict[str, Any] | None = None  # vLLM's extension: one of json, regex, choice, grammar, json_object
    # the older names clients still send: vLLM's guided_* and llama.cpp's server's json_schema / grammar (GBNF)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(max_length=4096)] | None = None
    guided_grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    grammar: str | None = None
    # Applied to the target's and the draft's rows alike (runtime/penalties.py), so output stays the target's:
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0  # vLLM's extension
    min_p: float | None = 0.0  # vLLM's extension
    min_tokens: int | None = 0  # vLLM's extension: no EOS / stop_token_ids before this many tokens
    logit_bias: Annotated[dict[str, float], _LEN["logit_bias"]] | None = None  # token id (as a string) -> -100..100
    # Beam search (vLLM's use_beam_search; Hugging Face's semantics): width best_of (else n), the best n returned
    use_beam_search: bool = False
    length_penalty: float | None = 1.0
    early_stopping: bool | Literal["never"] | None = False

    def sampling(self) -> dict[str, Any]:
        """Keyword arguments of ``SamplingParams`` (it checks their values)."""
        return dict(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=None if self.top_p in (None, 1.0) else self.top_p,
            top_k=None if self.top_k in (None, 0, -1) else self.top_k,
            seed=None if self.seed is None else self.seed % 2**64,  # a negative seed (vLLM takes any int64) as its bits
            ignore_eos=self.ignore_eos,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0,
            min_tokens=self.min_tokens or 0,
            logit_bias={_token_key(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            structured_outputs=self.structured(),
        )

    def constraint_fields(self) -> list[str]:
        """The fields of the request that constrain its output (at most one may)."""
        fmt = self.response_format
        return ((["response_format"] if fmt is not None and fmt.type != "text" else []) + (["structured_outputs"] if self.structured_outputs is not None else [])
                + [name for name in ALIASES if getattr(self, name) is not None])  # fmt: skip

    def structured(self) -> StructuredOutputs | None:
        """The request's constraint: ``response_format`` (OpenAI's), ``structured_outputs``
        (vLLM's) or an older name of one (``ALIASES``), one of them; a ``FieldError`` names the
        field that is wrong."""
        fmt, so = self.response_format, self.structured_outputs
        aliases = {name: getattr(self, name) for name in ALIASES if getattr(self, name) is not None}
        given = self.constraint_fields()
        if len(given) > 1:
            raise FieldError(f"{' and '.join(given)} all constrain the output; send one of them", given[-1])
        if not given:
            return None
        try:
            if aliases:
                (name, value), = aliases.items()
                return StructuredOutputs(**{ALIASES[name]: value})
            if so is not None:
                return StructuredOutputs.of(so)
            if fmt.type == "json_object":
                return StructuredOutputs(json=fmt.schema_) if fmt.schema_ is not None else StructuredOutputs(json_object=True)
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise FieldError("response_format type 'json_schema' needs json_schema.schema (the JSON schema the output follows)", "response_format")
            return StructuredOutputs(json=fmt.json_schema.schema_)
        except FieldError:
            raise
        except InputError as e:
            raise FieldError(str(e), given[0]) from None

    def constraint_field(self) -> str | None:
        """The field a constraint's error names (None: no constraint)."""
        return next(iter(self.constraint_fields()), None)

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def choices(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def rows(self) -> int:
        """Rows decoded per prompt: ``best_of`` of them when asked (the best ``n`` returned)."""
        return getattr(self, "best_of", None) or self.choices


def _token_key(key: str) -> int:
    """A logit_bias key: a token id written as a string, as JSON object keys are."""
    try:
        return int(key)
    except ValueError:
        raise FieldError(f"logit_bias key {key[:40]!r}: expected a token id (an integer, as a string)", "logit_bias") from None


class CompletionRequest(_Sampling):
    prompt: str | _Ids | Annotated[list[str], _LEN["prompt list"]] | Annotated[list[_Ids], _LEN["prompt list"]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    best_of: int | None = None  # rows decoded per prompt; the n with the highest cumulative logprob are returned
    logprobs: int | None = None  # the target's log-probability of each token, with this many alternatives
    echo: bool | None = False  # the prompt before the completion (and, with logprobs, its tokens' logprobs)
    suffix: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class CalledFunction(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    """A tool call of an assistant message sent back."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class Function(_Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # required and named calls are always held to the schema


class Tool(_Body):
    type: Literal["function"]
    function: Function


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class Message(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | Annotated[list[TextPart], _LEN["content"]] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], _LEN["tool_calls"]] | None = None  # an assistant's calls, sent back
    tool_call_id: str | None = None  # a tool message: the call it answers
    # what the openai library dumps for an assistant message sent back: accepted when empty (_MESSAGE_OFF)
    refusal: str | None = None
    function_call: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    annotations: list[Any] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1, max_length=BOUNDS["messages"][0])
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM's extension
    chat_template_kwargs: Annotated[dict[str, Any], _LEN["chat_template_kwargs"]] | None = None  # vLLM's extension: extra template variables
    tools: Annotated[list[Tool], _LEN["tools"], Field(min_length=1)] | None = None  # OpenAI refuses an empty list too
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: "auto" with tools
    parallel_tool_calls: bool | None = None  # None: true

    def structured(self) -> StructuredOutputs | None:
        """A required or named tool call holds the output to the calls' JSON (serve/tools.py)."""
        from specdec.serve.tools import plan

        tools = plan(self)
        if tools is None or tools.constraint is None:
            return super().structured()
        if self.constraint_fields():
            raise FieldError(f"tool_choice={self.tool_choice if isinstance(self.tool_choice, str) else 'a named function'!r} holds the "
                             f"output to the tool calls; drop {' / '.join(self.constraint_fields())} or use tool_choice='auto'", "tool_choice")  # fmt: skip
        try:
            return tools.constraint
        except InputError as e:
            raise FieldError(f"tools: a function's parameters are not a usable JSON schema: {e}", "tools") from None

    def constraint_field(self) -> str | None:
        """The field a constraint's error names: ``tools`` for a required or named call."""
        from specdec.serve.tools import plan

        tools = plan(self)
        return "tools" if tools is not None and tools.constraint is not None else super().constraint_field()


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[Message], _LEN["messages"]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: Annotated[dict[str, Any], _LEN["chat_template_kwargs"]] | None = None


class DetokenizeRequest(_Body):
    """vLLM's /detokenize."""

    model: str | None = None
    tokens: _Ids


# older constraint fields -> the StructuredOutputs field each one is
ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar", "json_schema": "json",
           "grammar": "grammar"}  # fmt: skip
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


def parse(cls: type[_Body], raw: Any) -> _Body:
    """``raw`` (decoded JSON) as a ``cls``; an ``InputError`` names the first bad field."""
    if not isinstance(raw, dict):
        raise FieldError(f"request body is JSON {type(raw).__name__}; expected an object")
    try:
        body = cls.model_validate(raw)
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
    for name, (off, instead) in _OFF.items():
        value = getattr(body, name, None)
        if name in type(body).model_fields and value not in off:
            raise FieldError(f"{name}={value!r} is not supported (only {off[0]!r}): {instead}", name)
    for i, m in enumerate(getattr(body, "messages", None) or ()):
        for name, (off, why) in _MESSAGE_OFF.items():
            if getattr(m, name) not in off:
                raise FieldError(f"messages.{i}.{name}={str(getattr(m, name))[:60]!r}: {why}", f"messages.{i}.{name}")
    if isinstance(body, TokenizeRequest) and (body.prompt is None) == (body.messages is None):
        raise FieldError("send either prompt or messages to tokenize", "prompt")
    if isinstance(body, (TokenizeRequest, DetokenizeRequest)):
        return body
    if isinstance(body, ChatCompletionRequest):
        _check_tools(body)
    body.structured()  # a bad constraint is refused here, naming its field (its grammar is compiled on admission)
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
    _check_beam_fields(body)
    clash = sorted(set(getattr(body, "chat_template_kwargs", None) or ()) & set(RESERVED_TEMPLATE_NAMES))
    if clash:
        raise FieldError(f"chat_template_kwargs: {clash} are set by the request itself; rename or remove them", "chat_template_kwargs")
    return body


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


def is_list_of_prompts(prompt) -> bool:
    """``prompt`` is a list of prompts (strings or token-id lists), not one prompt of ids."""
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


def prompts_of(body: CompletionRequest) -> list:
    """The request's prompts, each a string or a token-id list."""
    return list(body.prompt) if is_list_of_prompts(body.prompt) else [body.prompt]


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

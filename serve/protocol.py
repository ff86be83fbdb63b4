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

The models are here; ``parse`` (serve/validation.py) turns a decoded body into one, with the
checks across fields.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specdec.errors import InputError
from specdec.runtime.constraints import StructuredOutputs


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
    cache_salt: str | None = Field(default=None, min_length=1, max_length=200)  # vLLM's: prefix reuse only among requests with the same salt
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
    # what the openai library dumps for an assistant message sent back: accepted when empty (validation.py's _MESSAGE_OFF)
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


def is_list_of_prompts(prompt) -> bool:
    """``prompt`` is a list of prompts (strings or token-id lists), not one prompt of ids."""
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


def prompts_of(body: CompletionRequest) -> list:
    """The request's prompts, each a string or a token-id list."""
    return list(body.prompt) if is_list_of_prompts(body.prompt) else [body.prompt]

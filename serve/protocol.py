"""The OpenAI wire format the server accepts: request bodies checked strictly, refused with the field named.

Fields follow OpenAI's completions and chat completions APIs, with vLLM's extension fields
(``top_k``, ``ignore_eos``, ``stop_token_ids``, ``return_token_ids``). A field the server does
not implement is refused (400 naming it) rather than silently ignored, unless its value is the
one that means "off" (``n=1``, ``echo=false``, ``logprobs=null``, penalties 0, ...), which
clients often send explicitly.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specdec.errors import InputError


class FieldError(InputError):
    """A request field is wrong; ``param`` names it (OpenAI's error body carries it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class _Body(BaseModel):
    # strict: "5" is not an int and true is not a number; extra: an unknown field is an error
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class _Sampling(_Body):
    model: str
    max_tokens: int | None = None
    temperature: float | None = 1.0  # OpenAI's default: sampled; null (as some clients send) means the default
    top_p: float | None = 1.0
    top_k: int | None = None  # vLLM: -1 or 0 turn it off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    user: str | None = None  # metadata; not used
    # Accepted only at their "off" value (see ``_OFF``):
    n: int | None = 1
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None

    def sampling(self) -> dict[str, Any]:
        """Keyword arguments of ``BatchEngine.submit`` (the engine checks their values)."""
        return dict(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=None if self.top_p in (None, 1.0) else self.top_p,
            top_k=None if self.top_k in (None, 0, -1) else self.top_k,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            stop_token_ids=tuple(self.stop_token_ids or ()),
        )

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM's extension
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension: extra template variables


_EXACT = "it would change the target's distribution, which specdec keeps exact"
# field -> (values that mean "off", what to do instead)
_OFF = {
    "n": ((1, None), "send one request per completion"),
    "best_of": ((None, 1), "send several requests and pick"),
    "logprobs": ((None, False), "log-probabilities are not returned yet"),
    "top_logprobs": ((None,), "log-probabilities are not returned yet"),
    "echo": ((False, None), "prepend the prompt yourself"),
    "suffix": ((None,), "insertion is not supported"),
    "presence_penalty": ((0.0, None), _EXACT),
    "frequency_penalty": ((0.0, None), _EXACT),
    "logit_bias": ((None, {}), _EXACT),
}
_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none"}


def _where(loc: tuple) -> str:
    """A pydantic error location as a field path ("messages.0.content"), without the names of
    union members pydantic puts in it."""
    keep = [str(p) for p in loc if isinstance(p, int) or not ("[" in p or p[:1].isupper() or p.lower() in _TYPE_NAMES)]
    return ".".join(keep)


def parse(cls: type[_Body], raw: Any) -> _Body:
    """``raw`` (decoded JSON) as a ``cls``; an ``InputError`` names the first bad field."""
    if not isinstance(raw, dict):
        raise FieldError(f"request body is JSON {type(raw).__name__}; expected an object")
    try:
        body = cls.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        field = _where(err["loc"])
        if err["type"] == "extra_forbidden":
            raise FieldError(f"{field}: unsupported field; specdec does not implement it, remove it from the request", field) from None
        if err["type"] == "missing":
            raise FieldError(f"{field} is required", field) from None
        if sum(x["loc"][:1] == err["loc"][:1] for x in e.errors()) > 1 and len(err["loc"]) > 1:  # a union: no member fits
            top = str(err["loc"][0])
            kind = getattr(cls.model_fields.get(top), "annotation", "?")
            raise FieldError(f"{top}={str(raw.get(top))[:60]!r}: expected {kind}", top) from None
        raise FieldError(f"{field}={str(err.get('input'))[:60]!r}: {err['msg'].lower()}", field) from None
    for name, (off, instead) in _OFF.items():
        value = getattr(body, name, None)
        if name in type(body).model_fields and value not in off:
            raise FieldError(f"{name}={value!r} is not supported (only {off[0]!r}): {instead}", name)
    if isinstance(body, CompletionRequest) and isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int):
        raise FieldError("prompt: a list of prompts is not supported; send one request per prompt", "prompt")
    return body

"""The two generation endpoints' differences: ``Completions`` (/v1/completions) and ``Chat``
(/v1/chat/completions) each say how a request becomes prompts, its token budget, the logprobs it
asks for, and what one choice of the answer looks like.
"""

from __future__ import annotations

import itertools

from specdec.runtime.text import TextCodec
from specdec.serve.protocol import ChatCompletionRequest, CompletionRequest, FieldError, prompts_of
from specdec.serve.state import ServerState
from specdec.serve.tools import plan, template_messages, with_tools


def finite(v: float) -> float:
    """A logprob as JSON can carry it: a token the settings exclude (-inf) as vLLM writes it, -9999.0."""
    return v if v > -9999.0 else -9999.0


def encode(state: ServerState, text: str, special: bool, param: str) -> list[int]:
    """A prompt's ids; text too long to fit in the context whatever it says is refused before
    the tokenizer reads it (runtime/text.py ``max_chars``)."""
    limit = state.codec.max_chars(state.max_seq_len)
    if len(text) > limit:
        raise FieldError(f"{param}: {len(text)} characters; with this tokenizer no text over {limit} characters fits in the "
                         f"{state.max_seq_len} tokens of the context (max_model_len); shorten it", param)  # fmt: skip
    return state.codec.encode(text, special)


class Completions:
    object, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl"

    @staticmethod
    def prompts(state: ServerState, body: CompletionRequest) -> list[list[int]]:
        out = []
        for prompt in prompts_of(body):
            if isinstance(prompt, list):
                out.append(prompt)  # the engine checks the ids against the vocabulary
            elif state.codec is None:
                raise FieldError("prompt is text but the bundle has no tokenizer; send token ids", "prompt")
            else:
                out.append(encode(state, prompt, True, "prompt"))
        return out

    @staticmethod
    def max_tokens(body: CompletionRequest) -> int | None:
        return body.max_tokens

    @staticmethod
    def logprobs(body: CompletionRequest) -> tuple[int | None, int | None]:
        """(alternatives per generated token, per prompt token): None when not asked."""
        return body.logprobs, body.logprobs if body.echo and body.logprobs is not None else None

    @staticmethod
    def choice(index: int, text: str, finish: str | None, first: bool, stream: bool, scored=None, codec=None, offset: int = 0) -> dict:
        """``scored``: (position, TokenLogprob or None) pairs of this piece, as OpenAI's legacy
        logprobs object (tokens, token_logprobs, top_logprobs, text_offset from ``offset``)."""
        logprobs = None
        if scored is not None:
            words = [word(codec, tok) for tok, _ in scored]
            offsets = list(itertools.accumulate((len(w) for w in words[:-1]), initial=offset)) if words else []
            logprobs = {"tokens": words, "token_logprobs": [finite(lp.logprob) if lp else None for _, lp in scored],
                        "top_logprobs": [{word(codec, t): finite(v) for t, v in lp.top} if lp else None for _, lp in scored],
                        "text_offset": offsets}  # fmt: skip
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


class Chat:
    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    @staticmethod
    def prompts(state: ServerState, body: ChatCompletionRequest) -> list[list[int]]:
        if state.chat is None:
            raise FieldError("messages: this bundle has no chat template; start the server with --chat-template FILE, or use /v1/completions", "messages")
        if state.codec is None:
            raise FieldError("messages: the bundle has no tokenizer to encode a chat; use /v1/completions with token ids", "messages")
        tools = plan(body)
        extra = {**(body.chat_template_kwargs or {}), **({"tools": list(tools.tools)} if tools else {})}
        messages = template_messages(body.messages)
        if tools is not None and tools.mode == "auto":  # required and named calls are held to their schemas anyway
            messages = with_tools(messages, tools, state.chat.source)
        text = state.chat.render(messages, body.add_generation_prompt, **extra)
        return [encode(state, text, False, "messages")]  # the template wrote the special tokens

    @staticmethod
    def max_tokens(body: ChatCompletionRequest) -> int | None:
        return body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens

    @staticmethod
    def logprobs(body: ChatCompletionRequest) -> tuple[int | None, int | None]:
        return (body.top_logprobs or 0) if body.logprobs else None, None

    @staticmethod
    def choice(index: int, text: str, finish: str | None, first: bool, stream: bool, scored=None, codec=None, offset: int = 0) -> dict:
        """``scored``: (token, TokenLogprob) pairs as the chat logprobs object ({"content": [...]})."""

        def entry(t: int, v: float) -> dict:
            w = word(codec, t)
            return {"token": w, "logprob": finite(v), "bytes": list(w.encode())}

        logprobs = None
        if scored is not None:
            logprobs = {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for _, lp in scored],
                        "refusal": None}  # fmt: skip
        if not stream:
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs, "finish_reason": finish}
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text or finish is None else {})
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def word(codec: TextCodec | None, token: int) -> str:
    """One token as text (vLLM's "token_id:N" without a tokenizer)."""
    return codec.decode([token]) if codec is not None else f"token_id:{token}"

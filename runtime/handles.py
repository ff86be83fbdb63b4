"""A request's handle: the engine pushes tokens, the caller reads pieces.

The same object serves both drivers. ``BatchEngine``: the engine thread pushes and the
caller's thread reads; thread-safe by construction, since the engine only calls ``push`` /
``finish`` and the caller iterates, waits on ``result()`` or calls ``cancel()``.
``SpeculativeDecoder``: a handle with a ``pump`` steps the engine on the caller's thread
whenever no piece is waiting. Text is decoded on the caller's side, so an engine thread
spends no time in the tokenizer.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import AsyncIterator, Callable, Iterator, NamedTuple

from specdec.runtime.logprobs import TokenLogprob
from specdec.runtime.request import Request
from specdec.runtime.stats import Stats
from specdec.runtime.text import Detokenizer, TextCodec

_END = object()


class Piece(NamedTuple):
    """Tokens accepted by one iteration, and the text they complete (None without a tokenizer);
    with ``logprobs`` asked, one ``TokenLogprob`` per token."""

    tokens: list[int]
    text: str | None
    logprobs: list[TokenLogprob] | None = None


class GenerationResult(NamedTuple):
    tokens: list[int]  # generated tokens only (an EOS that stopped decoding is included)
    text: str | None  # decoded text when the bundle has a tokenizer
    stats: Stats
    logprobs: list[TokenLogprob] | None = None  # per generated token, when asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (the first: None), when asked


class Handle:
    """One request in a ``BatchEngine``: iterate (once) for ``Piece``s as tokens are accepted,
    ``result()`` to wait for the whole output, ``cancel()`` to stop it (its slot is freed within
    one engine iteration; the result then has ``finish_reason == "cancelled"``)."""

    def __init__(self, request: Request, codec: TextCodec | None, stats: Stats, pump: Callable[[], None] | None = None):
        """``pump``: run on the reader's thread while no piece waits (one engine step), or None
        when another thread pushes."""
        self.request, self.codec, self.stats, self.pump = request, codec, stats, pump
        self.tokens: list[int] = []  # filled by the engine thread
        self.logprobs: list[TokenLogprob] | None = [] if request.params.logprobs is not None else None  # aligned with tokens
        self.prompt_logprobs: list[TokenLogprob | None] | None = [None] if request.params.prompt_logprobs is not None else None
        self.error: BaseException | None = None  # set when the engine failed this request
        self.start_time = 0.0  # when the engine took it (perf_counter)
        self.cancelled = threading.Event()
        self.done = threading.Event()
        self._pieces: queue.SimpleQueue = queue.SimpleQueue()
        self._notify: Callable[[], None] | None = None  # set by __aiter__: wakes an asyncio reader

    # -- engine side ----------------------------------------------------------------------

    def push(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        self.tokens += tokens
        if self.logprobs is not None and logprobs is not None:
            self.logprobs += logprobs
        self._pieces.put((tokens, logprobs))
        if self._notify:
            self._notify()

    def finish(self, reason: str | None = None, error: BaseException | None = None) -> None:
        if reason:
            self.stats.finish_reason = reason
        self.error = error
        self.done.set()
        self._pieces.put(_END)
        if self._notify:
            self._notify()

    # -- caller side ----------------------------------------------------------------------

    def cancel(self) -> None:
        self.cancelled.set()

    def __iter__(self) -> Iterator[Piece]:
        detok = Detokenizer(self.codec) if self.codec else None
        while (item := self._next()) is not _END:
            yield Piece(item[0], detok.push(item[0]) if detok else None, item[1])
        yield from self._ending(detok)

    def _next(self):
        if self.pump is not None:
            while self._pieces.empty():
                self.pump()
        return self._pieces.get()

    async def __aiter__(self) -> AsyncIterator[Piece]:
        """As ``__iter__``, for an asyncio reader: waits without blocking the event loop (the
        engine thread wakes it through ``loop.call_soon_threadsafe``). Iterate once, either way."""
        loop, wake = asyncio.get_running_loop(), asyncio.Event()

        def notify() -> None:  # on the engine thread
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the reader's loop is closed: nobody waits, and the engine must go on
                pass

        self._notify = notify
        detok = Detokenizer(self.codec) if self.codec else None
        while True:
            try:
                item = self._pieces.get_nowait()
            except queue.Empty:
                await wake.wait()  # set by any push since the last clear, so none is missed
                wake.clear()
                continue
            if item is _END:
                break
            yield Piece(item[0], detok.push(item[0]) if detok else None, item[1])
        for piece in self._ending(detok):
            yield piece

    def _ending(self, detok: Detokenizer | None) -> Iterator[Piece]:
        """After the last push: the text held back for an incomplete character, then the
        engine's error if it failed the request."""
        if detok and (tail := detok.flush()):
            yield Piece([], tail)
        if self.error is not None:
            raise self.error

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Wait for the end (``TimeoutError`` after ``timeout`` seconds); raises the engine's error if it failed."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"request not finished after {timeout} s")
        if self.error is not None:
            raise self.error
        text = self.codec.decode(self.tokens) if self.codec else None
        return GenerationResult(list(self.tokens), text, self.stats, self.logprobs, self.prompt_logprobs)

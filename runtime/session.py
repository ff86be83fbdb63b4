"""A live sequence on a ``SpeculativeDecoder``: multi-turn without re-reading the history.

    s = decoder.session(system_prompt)
    s.append(user_turn)                  text (encoded alone) or token ids
    reply = s.generate(max_new_tokens=…)  decodes from where the sequence stands; its tokens join it
    s.rewind_to(n)                        forget every token from n on (the cache follows lazily)
    s.tokens                              the whole sequence

Each ``generate`` / ``stream`` runs the whole sequence as the prompt with reuse on: the engine
keeps the cache rows it holds for the prefix the sequence shares with the last request in its
slot (``Engine.reusable``), so only the tokens appended since are fed. Any drafter works, and
prompt lookup and the n-gram drafter see the whole sequence. Another request on the same
decoder in between takes the slot; the next turn then feeds the history once more (still exact).
"""

from __future__ import annotations

from typing import Iterator, Sequence

from specdec.errors import ConfigError, InputError
from specdec.runtime.handles import GenerationResult, Piece
from specdec.runtime.request import token_ids


class Session:
    """See the module docstring. Not thread-safe: one session is one conversation."""

    def __init__(self, decoder, tokens: str | Sequence[int] = ()):  # decoder: a SpeculativeDecoder
        if decoder.manifest.seq2seq:
            raise ConfigError("sessions need a decoder-only bundle: an encoder-decoder's output depends on its source; call generate(source) per turn")
        self.decoder = decoder
        self._tokens: list[int] = []
        self.last: GenerationResult | None = None  # the last turn's result (tokens, text, stats)
        if len(tokens):
            self.append(tokens)

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def append(self, x: str | Sequence[int], special: bool | None = None) -> list[int]:
        """Add text or token ids at the end; returns the ids added. Text is encoded on its own,
        with the tokenizer's special tokens (a BOS) only when the session is empty, unless
        ``special`` says otherwise (render a chat turn with its template, then append it)."""
        if isinstance(x, str):
            if self.decoder.codec is None:
                raise InputError("text appended to a session, but the bundle has no tokenizer; append token ids")
            ids = self.decoder.codec.encode(x, not self._tokens if special is None else special)
        else:
            ids = token_ids(x, self.decoder.manifest.vocab_size, "appended tokens").tolist()
        self._tokens += ids
        return ids

    def rewind_to(self, n: int) -> None:
        """Forget every token from position ``n`` on (the cache rows follow at the next turn)."""
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(self._tokens):
            raise InputError(f"rewind_to({n!r}): expected a position in 0..{len(self._tokens)} (the session's length)")
        del self._tokens[n:]

    def generate(self, **fields) -> GenerationResult:
        """Decode from where the sequence stands (fields as ``SpeculativeDecoder.generate``); the
        tokens decoded join the sequence."""
        for _ in self._run(fields, incremental_text=False):
            pass
        return self.last

    def stream(self, **fields) -> Iterator[Piece]:
        """``generate`` as pieces; the tokens join the sequence as they come (also when the
        stream is closed early). The request is checked here, before any work."""
        return self._run(fields, incremental_text=True)

    def _run(self, fields: dict, incremental_text: bool) -> Iterator[Piece]:
        """Check the turn's request now; decode it as the returned iterator is read."""
        if not self._tokens:
            raise InputError("the session is empty: append a prompt before generating")
        req = self.decoder.request(self._tokens, **fields)
        return self._pieces(self.decoder.run(req, incremental_text, reuse=True))

    def _pieces(self, stream) -> Iterator[Piece]:
        try:
            for piece in stream:
                self._tokens += piece.tokens
                yield piece
        finally:
            stream.close()
            self.last = stream.result

    def __repr__(self) -> str:
        return f"Session({len(self._tokens)} tokens)"

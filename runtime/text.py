"""The bundle's tokenizer (``tokenizers`` only) and incremental detokenization for streams."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

from specdec.errors import BundleError
from specdec.manifest import Manifest, inside

if TYPE_CHECKING:
    from specdec.runtime.constraints import Grammars

REPLACEMENT = "\ufffd"  # what a decoder prints for an incomplete UTF-8 sequence
NORMALIZER_SLACK = 4  # a normalizer may shorten text (NFC composes a letter and its accent); 4x covers it


class TextCodec:
    """Encode prompts and decode outputs with the bundle's ``tokenizer.json``."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception type
            raise BundleError(f"{path} is not a readable tokenizer.json ({str(e).splitlines()[0]}); re-export the bundle") from None
        self._grammars = None
        self._lock = threading.Lock()
        self._longest: int | None = None  # characters of the longest vocabulary entry (max_chars)

    def grammars(self, limits) -> Grammars:
        """The compiled grammars over this tokenizer (built on first use: ~0.2 s at 49k tokens)."""
        with self._lock:
            if self._grammars is None:
                from specdec.runtime.constraints import Grammars

                self._grammars = Grammars(self.tokenizer.to_str(), limits.vocab_size, limits.eos_token_ids)
            return self._grammars

    @classmethod
    def from_bundle(cls, bundle: Path, manifest: Manifest) -> TextCodec | None:
        if manifest.tokenizer is None:
            return None
        path = inside(bundle, manifest.tokenizer) / "tokenizer.json"
        return cls(path) if path.is_file() else None

    def max_chars(self, tokens: int) -> int:
        """Characters past which no text encodes to ``tokens`` tokens or fewer: a token stands
        for at most the longest vocabulary entry's characters (byte-level entries spell a byte
        per character, so they are never shorter than the text they decode to), times
        ``NORMALIZER_SLACK`` for normalizers that shorten text (Unicode composition).
        A server refuses a longer prompt without tokenizing it: 8 MiB of text takes ~14 s here."""
        if self._longest is None:
            self._longest = max(map(len, self.tokenizer.get_vocab(with_added_tokens=True)), default=1)
        return tokens * self._longest * NORMALIZER_SLACK

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids, with the tokenizer's own special tokens added (as transformers' default)
        unless ``special`` is False (text that has them already, such as a rendered chat)."""
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class Detokenizer:
    """Turns a growing token list into text deltas, holding back an incomplete character.

    Each push decodes only a short window: the tokens since the last emitted delta plus the
    ones just before them (so byte-level merges and leading spaces decode as in the full text),
    not the whole list: O(new tokens) per push, not O(all tokens).
    """

    def __init__(self, codec: TextCodec):
        self.codec = codec
        self.ids: list[int] = []
        self.prefix = 0  # window start: tokens before it are settled
        self.read = 0  # tokens up to here have been returned as text

    def push(self, tokens: list[int]) -> str:
        self.ids += tokens
        before = self.codec.decode(self.ids[self.prefix : self.read])
        text = self.codec.decode(self.ids[self.prefix :])
        if len(text) <= len(before) or text.endswith(REPLACEMENT):
            return ""  # nothing new yet, or wait for the rest of the character
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before) :]

    def flush(self) -> str:
        before = self.codec.decode(self.ids[self.prefix : self.read])
        text = self.codec.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(before) :]

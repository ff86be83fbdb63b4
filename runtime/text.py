"""The bundle's tokenizer (``tokenizers`` only) and incremental detokenization for streams."""

from __future__ import annotations

from pathlib import Path

from specdec.errors import BundleError
from specdec.manifest import Manifest, inside

REPLACEMENT = "\ufffd"  # what a decoder prints for an incomplete UTF-8 sequence


class TextCodec:
    """Encode prompts and decode outputs with the bundle's ``tokenizer.json``."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception type
            raise BundleError(f"{path} is not a readable tokenizer.json ({str(e).splitlines()[0]}); re-export the bundle") from None

    @classmethod
    def from_bundle(cls, bundle: Path, manifest: Manifest) -> TextCodec | None:
        if manifest.tokenizer is None:
            return None
        path = inside(bundle, manifest.tokenizer) / "tokenizer.json"
        return cls(path) if path.is_file() else None

    def encode(self, text: str) -> list[int]:
        """Token ids with the tokenizer's own special tokens (as transformers' default)."""
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class Detokenizer:
    """Turns a growing token list into text deltas, holding back an incomplete character."""

    def __init__(self, codec: TextCodec):
        self.codec = codec
        self.ids: list[int] = []
        self.sent = 0  # characters already returned

    def push(self, tokens: list[int]) -> str:
        self.ids += tokens
        text = self.codec.decode(self.ids)
        if text.endswith(REPLACEMENT):
            return ""  # wait for the rest of the character
        delta, self.sent = text[self.sent :], len(text)
        return delta

    def flush(self) -> str:
        text = self.codec.decode(self.ids)
        delta, self.sent = text[self.sent :], len(text)
        return delta

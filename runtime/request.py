"""A decoding request that checks itself when built, against what its bundle allows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from specdec.errors import ConfigError, InputError
from specdec.runtime.sampling import SamplingConfig
from specdec.runtime.speculative import check_lenience


@dataclass(frozen=True)
class Limits:
    """What a bundle allows a request (read off its manifest)."""

    vocab_size: int
    max_seq_len: int
    max_gamma: int  # the verify graph takes K = max_gamma + 1 tokens
    eos_token_ids: tuple[int, ...]
    max_source_len: int | None = None  # an encoder-decoder bundle's source tokens; None: decoder-only

    @classmethod
    def of(cls, manifest) -> Limits:
        return cls(manifest.vocab_size, manifest.max_seq_len, manifest.gamma, tuple(manifest.eos_token_ids), manifest.max_source_len)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def token_ids(prompt: Sequence[int] | np.ndarray, vocab: int, what: str = "prompt") -> np.ndarray:
    """``prompt`` as a flat int64 array [P] of ids in [0, vocab); an InputError names what is wrong
    (``what``: the argument's name in the message)."""
    try:
        arr = np.asarray(prompt)
    except (TypeError, ValueError):  # ragged nesting
        arr = np.asarray([[]])
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InputError(f"{what} {str(prompt)[:60]!r}: expected a string or a flat list of integer token ids")
    if arr.size == 0:
        raise InputError(f"{what} is empty: it needs at least one token")
    bad = arr[(arr < 0) | (arr >= vocab)]
    if bad.size:
        raise InputError(f"{what} token id {int(bad[0])} is outside the vocabulary [0, {vocab}); pass ids from the bundle's tokenizer")
    return arr.astype(np.int64)


@dataclass(frozen=True, eq=False)
class Request:
    """One request; building it checks every field and raises a ``ValueError`` subclass naming the
    first bad one, so nothing is decoded for a bad request.

    ``gamma``: draft tokens per target call, 0..the bundle's γ, None for the bundle's γ, or "auto"
    to choose it each iteration (§3.5) up to the bundle's γ; once built it holds the int ceiling
    and ``adaptive`` says whether it adapts. ``lenience``: 1 is exact; l < 1 accepts more drafts
    and changes the output distribution (no token above p(x) / l; App. A.5). ``stop_token_ids``:
    tokens that end the request besides EOS (``ignore_eos`` drops only EOS), as vLLM's field.
    ``source``: an encoder-decoder bundle's input ids (required there, refused by a decoder-only
    bundle); ``prompt`` is then the decoder's start, beginning with its decoder_start_token_id.
    """

    prompt: np.ndarray  # [P] int64 token ids (a list is converted)
    limits: Limits
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    gamma: int | str | None = None
    ignore_eos: bool = False
    lenience: float = 1.0
    stop_token_ids: Sequence[int] = ()  # more tokens that end the request (kept), also with ignore_eos
    source: np.ndarray | None = None  # [N] int64: an encoder-decoder's source ids (a list is converted)
    sampling: SamplingConfig = field(init=False)
    adaptive: bool = field(init=False)
    stop: frozenset[int] = field(init=False)  # tokens that end the request (kept in the output)

    def __post_init__(self) -> None:
        lim, put = self.limits, lambda k, v: object.__setattr__(self, k, v)
        put("sampling", SamplingConfig(self.temperature, self.top_k, self.top_p))
        put("lenience", check_lenience(self.lenience))
        put("adaptive", self.gamma == "auto")
        gamma = lim.max_gamma if self.gamma is None or self.adaptive else self.gamma
        if not _is_int(gamma) or not 0 <= gamma <= lim.max_gamma:
            raise ConfigError(
                f"gamma={gamma!r}: this bundle's verify graph takes K={lim.max_gamma + 1} tokens, so gamma must be "
                f"0..{lim.max_gamma} or 'auto'; re-export with a larger --gamma for more"
            )
        put("gamma", int(gamma))
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens={self.max_new_tokens!r}: expected an integer >= 1")
        put("max_new_tokens", int(self.max_new_tokens))
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise InputError(f"seed={self.seed!r}: expected an integer >= 0 or None")
        self._check_source()
        put("prompt", token_ids(self.prompt, lim.vocab_size))
        need = len(self.prompt) + self.max_new_tokens + lim.max_gamma
        if need > lim.max_seq_len:
            raise InputError(
                f"prompt ({len(self.prompt)} tokens) + max_new_tokens ({self.max_new_tokens}) + the bundle's gamma "
                f"({lim.max_gamma}) = {need} exceeds max-seq-len {lim.max_seq_len}; shorten the request or re-export "
                f"with a larger --max-seq-len"
            )
        extra = self.stop_token_ids
        if isinstance(extra, (str, bytes)) or not hasattr(extra, "__iter__") or not all(_is_int(t) and 0 <= t < lim.vocab_size for t in extra):
            raise InputError(f"stop_token_ids={extra!r}: expected a list of token ids in [0, {lim.vocab_size})")
        put("stop_token_ids", tuple(int(t) for t in extra))
        eos = frozenset() if self.ignore_eos else frozenset(lim.eos_token_ids)
        put("stop", eos | frozenset(self.stop_token_ids))

    def _check_source(self) -> None:
        lim = self.limits
        if lim.max_source_len is None:
            if self.source is not None:
                raise InputError("source: this bundle is decoder-only and takes a prompt, not a source; pass the text as the prompt")
            return
        if self.source is None:
            raise InputError("source is missing: this is an encoder-decoder bundle; pass the source text or ids (generate(source))")
        src = token_ids(self.source, lim.vocab_size, "source")
        if len(src) > lim.max_source_len:
            raise InputError(
                f"source of {len(src)} tokens exceeds the bundle's max-source-len {lim.max_source_len}; "
                "shorten it or re-export with a larger --max-source-len"
            )
        object.__setattr__(self, "source", src)

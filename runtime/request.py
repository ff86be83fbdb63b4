"""A decoding request that checks itself when built, against what its bundle allows."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from specdec.errors import InputError
from specdec.runtime.gamma import resolve as resolve_gamma
from specdec.runtime.params import SamplingParams
from specdec.runtime.constraints import Grammars, GrammarState
from specdec.runtime.penalties import Penalties
from specdec.runtime.sampling import SamplingConfig


@dataclass(frozen=True)
class Limits:
    """What a bundle allows a request (read off its manifest)."""

    vocab_size: int
    max_seq_len: int
    max_gamma: int  # the verify graph takes K = max_gamma + 1 tokens
    eos_token_ids: tuple[int, ...]
    max_source_len: int | None = None  # an encoder-decoder bundle's source tokens; None: decoder-only
    default_gamma: int | None = None  # a request's γ when it names none; None: max_gamma

    @classmethod
    def of(cls, manifest, drafter=None) -> Limits:
        """``drafter``: the engine's; with the bundle's default drafter, requests default to its γ."""
        name, gamma = manifest.default_drafter()
        eos = tuple(e for e in manifest.eos_token_ids if 0 <= e < manifest.vocab_size)  # an older bundle may name one outside
        return cls(manifest.vocab_size, manifest.max_seq_len, manifest.gamma, eos, manifest.max_source_len,
                   gamma if drafter == name else None)  # fmt: skip


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
    """One request checked against its bundle: its input and its ``SamplingParams``. Building it
    raises a ``ValueError`` subclass naming the first bad field, so nothing is decoded for a bad
    request.

    Once built, ``gamma`` is the int ceiling and ``adaptive`` says whether it adapts; ``stop`` is
    every token that ends the request (kept in the output). ``source``: an encoder-decoder
    bundle's input ids (required there, refused by a decoder-only bundle); ``prompt`` is then
    the decoder's start, beginning with its decoder_start_token_id.
    """

    prompt: np.ndarray  # [P] int64 token ids (a list is converted)
    limits: Limits
    params: SamplingParams = SamplingParams()
    source: np.ndarray | None = None  # [N] int64: an encoder-decoder's source ids (a list is converted)
    grammars: Grammars | None = None  # the bundle's compiled grammars (``make_request`` passes them)
    sampling: SamplingConfig = field(init=False)
    gamma: int = field(init=False)
    adaptive: bool = field(init=False)
    stop: frozenset[int] = field(init=False)  # tokens that end the request (kept in the output)
    penalties: Penalties | None = field(init=False)  # None: raw logits go to sampling as they are
    prompt_seen: np.ndarray = field(init=False)  # [u] the prompt's distinct ids (the repetition penalty's)

    def __post_init__(self) -> None:
        lim, par, put = self.limits, self.params, lambda k, v: object.__setattr__(self, k, v)
        if not isinstance(par, SamplingParams):
            raise InputError(f"params={par!r}: expected a SamplingParams")
        put("sampling", par.sampling)
        gamma, adaptive = resolve_gamma(par.gamma, lim.max_gamma, lim.default_gamma)
        put("gamma", gamma)
        put("adaptive", adaptive)
        self._check_source()
        put("prompt", token_ids(self.prompt, lim.vocab_size))
        # No room is reserved for the γ look-ahead: a step drafts at most the tokens the request may
        # still emit minus one (``step.schedule``), so its rows never pass prompt + max_new_tokens.
        need = len(self.prompt) + par.max_new_tokens
        if need > lim.max_seq_len:
            raise InputError(
                f"prompt ({len(self.prompt)} tokens) + max_new_tokens ({par.max_new_tokens}) = {need} exceeds max-seq-len "
                f"{lim.max_seq_len}; shorten the request or re-export with a larger --max-seq-len"
            )
        bad = [t for t in par.stop_token_ids if t >= lim.vocab_size]
        if bad:
            raise InputError(f"stop_token_ids={list(par.stop_token_ids)!r}: expected token ids in [0, {lim.vocab_size})")
        eos = frozenset() if par.ignore_eos else frozenset(lim.eos_token_ids)
        put("stop", eos | frozenset(par.stop_token_ids))
        bad = [t for t in par.logit_bias or {} if t >= lim.vocab_size]
        if bad:
            raise InputError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {lim.vocab_size}); pass ids from the bundle's tokenizer")
        pen = par.penalties
        if par.min_tokens and self.stop:  # the stop tokens are the request's: known here
            pen = replace(pen or Penalties(), min_tokens=par.min_tokens, stop_ids=tuple(sorted(self.stop)))
        put("penalties", pen)
        put("prompt_seen", np.unique(self.prompt))
        self._check_grammar()

    def _check_grammar(self) -> None:
        """A structured output's grammar compiles (a bad spec is refused here, before any work)."""
        spec = self.params.structured_outputs
        if spec is None:
            return
        if self.grammars is None:
            raise InputError("structured_outputs needs the bundle's tokenizer (tokenizer.json), which this bundle lacks; re-export it with its tokenizer")
        self.grammars.compile(spec)  # compiled once per spec, cached: the row's matcher copies it

    def new_grammar(self) -> GrammarState | None:
        """A fresh matcher for a row decoding this request (structured outputs), else None: the
        request stays a value, its row holds what advances."""
        spec = self.params.structured_outputs
        return None if spec is None else self.grammars.state(spec, len(self.prompt))

    @property
    def fusable(self) -> bool:
        """Whether a fused draft graph can propose for it (it samples with temperature, top-k and
        top-p only)."""
        return self.penalties is None and not self.sampling.min_p and self.params.structured_outputs is None

    @property
    def input_ids(self) -> np.ndarray:
        """What the caller sent: an encoder-decoder request's source, else the prompt."""
        return self.prompt if self.source is None else self.source

    @property
    def max_new_tokens(self) -> int:
        return self.params.max_new_tokens

    @property
    def seed(self) -> int | None:
        return self.params.seed

    @property
    def lenience(self) -> float:
        return self.params.lenience

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


def make_request(prompt, params: SamplingParams, limits: Limits, codec, source=None, start_token: int | None = None) -> Request:
    """A checked ``Request`` from what a caller gives: text is encoded with ``codec`` (the
    bundle's tokenizer, or None: ids only).

    Encoder-decoder bundles (``start_token``: their decoder_start_token_id): the first argument
    is the source, or pass ``source`` and then ``prompt`` is a decoder prefix after the start token.
    The source is encoded with the tokenizer's special tokens (T5's and BART's EOS), a decoder
    prefix without them."""

    def encode(text: str, what: str, special: bool = True) -> list[int]:
        if codec is None:
            raise InputError(f"{what} is text but the bundle has no tokenizer; pass token ids instead")
        return codec.encode(text, special)

    if start_token is not None:
        if source is None:
            prompt, source = None, prompt
        if isinstance(source, str):
            source = encode(source, "source")
        if isinstance(prompt, str):
            prompt = encode(prompt, "prompt", special=False)
        prompt = [start_token] + ([] if prompt is None else token_ids(prompt, limits.vocab_size).tolist())
    elif isinstance(prompt, str):
        prompt = encode(prompt, "prompt")
    grammars = codec.grammars(limits) if codec is not None and params.structured_outputs is not None else None
    return Request(prompt, limits, params, source, grammars)

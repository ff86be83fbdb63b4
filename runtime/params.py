"""One frozen value for what a caller asks of a request besides its input: ``SamplingParams``.

Declared once here; the Python API, the CLI and the server build one and pass it whole
(``BatchEngine.submit(prompt, params)``, ``SpeculativeDecoder.generate(prompt, **fields)``).
A field is checked here when its bound does not depend on the bundle; ``Request`` checks the
rest (γ against the verify graph's K, lengths against max-seq-len, ids against the vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Mapping, Sequence

from specdec.errors import InputError
from specdec.runtime.beam import BeamConfig
from specdec.runtime.constraints import StructuredOutputs
from specdec.runtime.gamma import check as check_gamma, is_int
from specdec.runtime.logprobs import LOGPROBS_MODES, MAX_LOGPROBS
from specdec.runtime.penalties import Penalties
from specdec.runtime.sampling import SamplingConfig
from specdec.runtime.speculative import check_lenience


MAX_BEAMS = 32  # beams a search keeps (each holds a KV slot per model)
MAX_SALT = 256  # characters of a cache_salt


@dataclass(frozen=True)
class SamplingParams:
    """How one request decodes.

    ``gamma``: draft tokens per target call, 0..the bundle's γ, None for the bundle's γ, or
    "auto" to choose it each iteration (§3.5). ``lenience``: 1 is exact; l < 1 accepts more
    drafts and changes the output distribution (no token above p(x) / l; App. A.5).
    ``stop_token_ids``: tokens that end the request besides EOS (``ignore_eos`` drops only EOS),
    as vLLM's field. ``logprobs`` / ``prompt_logprobs``: the target's log-probability of each
    generated / prompt token with that many most likely alternatives (0: the token's own only;
    None: not computed), from the raw logits, or with ``logprobs_mode="processed"`` from the
    distribution sampled (after penalties, temperature, top-k, top-p, min-p; runtime/logprobs.py).
    ``presence_penalty`` / ``frequency_penalty`` (-2..2), ``repetition_penalty`` (> 0, 1 = off),
    ``logit_bias`` ({token id: -100..100}) and ``min_p`` follow vLLM; they transform the target's
    and the draft's rows alike, so the output is the target's under them (runtime/penalties.py).
    ``min_tokens`` (vLLM's) keeps EOS and ``stop_token_ids`` from being drawn before that many tokens.
    ``structured_outputs`` (vLLM's field; a ``StructuredOutputs`` or a dict of its fields) holds
    the output to a JSON schema, regex, choice or grammar: the target's and the draft's rows are
    masked alike, so the output is the target's own under the constraint (runtime/constraints.py).
    ``cache_salt`` (vLLM's field): a request reuses only KV rows that a request with the same salt
    left (prefix reuse, or rows copied from a request in flight with the same prompt); None is a
    class of its own. Tenants with different salts never see each other's prefixes, not even as time.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    gamma: int | str | None = None
    ignore_eos: bool = False
    lenience: float = 1.0
    stop_token_ids: Sequence[int] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprobs_mode: str = "raw"
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    structured_outputs: StructuredOutputs | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        self.sampling  # raises SamplingError on a bad value
        object.__setattr__(self, "structured_outputs", StructuredOutputs.of(self.structured_outputs))
        if self.structured_outputs is not None and self.ignore_eos:
            raise InputError("ignore_eos=True with structured_outputs: the output ends where the grammar is complete (with EOS); drop ignore_eos")
        object.__setattr__(self, "lenience", check_lenience(self.lenience))
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens={self.max_new_tokens!r}: expected an integer >= 1")
        if self.seed is not None and (not is_int(self.seed) or self.seed < 0):
            raise InputError(f"seed={self.seed!r}: expected an integer >= 0 or None")
        extra = self.stop_token_ids
        if isinstance(extra, (str, bytes)) or not hasattr(extra, "__iter__") or not all(is_int(t) and t >= 0 for t in extra):
            raise InputError(f"stop_token_ids={extra!r}: expected a list of token ids >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in extra))
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not is_int(k) or not 0 <= k <= MAX_LOGPROBS):
                raise InputError(f"{name}={k!r}: expected an integer in 0..{MAX_LOGPROBS} (alternatives per token) or None")
        salt = self.cache_salt
        if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > MAX_SALT):
            raise InputError(f"cache_salt={salt!r}: expected a non-empty string of at most {MAX_SALT} characters, or None")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise InputError(f"logprobs_mode={self.logprobs_mode!r}: expected one of {', '.join(LOGPROBS_MODES)}")
        self._check_penalties()

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and -2.0 <= v <= 2.0):
                raise InputError(f"{name}={v!r}: expected a number in [-2, 2] (0 = off)")
        m = self.min_tokens
        if not is_int(m) or not 0 <= m <= self.max_new_tokens:
            raise InputError(f"min_tokens={m!r}: expected an integer in 0..max_new_tokens ({self.max_new_tokens})")
        r = self.repetition_penalty
        if not (isinstance(r, (int, float)) and not isinstance(r, bool) and 0.0 < r < float("inf")):
            raise InputError(f"repetition_penalty={r!r}: expected a finite number > 0 (1 = off)")
        bias = self.logit_bias or {}
        if not isinstance(bias, Mapping):
            raise InputError(f"logit_bias={bias!r}: expected a mapping of token id to a bias in [-100, 100]")
        for t, b in bias.items():
            if not is_int(t) or t < 0 or not (isinstance(b, (int, float)) and not isinstance(b, bool) and -100.0 <= b <= 100.0):
                raise InputError(f"logit_bias entry {t!r}: {b!r}: expected a token id >= 0 and a bias in [-100, 100]")
        object.__setattr__(self, "logit_bias", {int(t): float(b) for t, b in sorted(bias.items())} or None)

    @property
    def penalties(self) -> Penalties | None:
        """The penalties to apply to raw logits, or None when every one is off."""
        bias = self.logit_bias or {}
        pen = Penalties(float(self.presence_penalty), float(self.frequency_penalty), float(self.repetition_penalty), tuple(bias), tuple(bias.values()))
        return pen if pen.active else None

    @classmethod
    def of(cls, **given) -> SamplingParams:
        """From keyword fields, as ``generate(**fields)`` passes them: an unknown name is an
        ``InputError`` naming it (a sampling field is never ignored, nor a TypeError)."""
        known = [f.name for f in fields(cls)]
        for name, value in given.items():
            if name not in known:
                hint = {"synthetic_acceptance": "; it is benchmark-only: specdec bench --synthetic-acceptance",
                        "num_beams": "; for beam search call beam_search() (SpeculativeDecoder.generate also takes num_beams)"}.get(name, "")
                raise InputError(f"{name}={value!r}: not a request field{hint}; expected one of {', '.join(known)}")
        return cls(**given)

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p, self.min_p)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


@dataclass(frozen=True)
class BeamParams:
    """How one beam search runs (``SpeculativeDecoder.beam_search``), in Hugging Face's terms.

    ``num_beams`` w, ``length_penalty`` (scores are divided by length ** it), ``early_stopping``
    (True, False or "never"), ``num_return_sequences`` (1..w), ``max_new_tokens``; EOS (unless
    ``ignore_eos``) and ``stop_token_ids`` finish a beam. ``gamma``: draft beam steps a target call
    verifies (0, the default: plain beam search with the target alone; None: the bundle's γ),
    and ``draft_width`` u >= 1 (None: w): the draft's beam width (the paper's App. A.4). The
    result is the same for every gamma and draft_width; only the time differs. Plain is the
    default because it was the faster wherever target calls cost their positions (every small
    model on a CPU measured; docs/beam-search.md); speculative pays when they cost their weights.
    """

    num_beams: int = 4
    max_new_tokens: int = 128
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    ignore_eos: bool = False
    stop_token_ids: Sequence[int] = ()
    gamma: int | None = 0
    draft_width: int | None = None

    def __post_init__(self) -> None:
        if not is_int(self.num_beams) or not 1 <= self.num_beams <= MAX_BEAMS:
            raise InputError(f"num_beams={self.num_beams!r}: expected an integer in 1..{MAX_BEAMS}")
        lp = self.length_penalty
        if not (isinstance(lp, (int, float)) and not isinstance(lp, bool) and abs(lp) < float("inf")):
            raise InputError(f"length_penalty={lp!r}: expected a finite number (1: scores per token, 0: sums)")
        if self.gamma is not None:
            check_gamma(self.gamma, None, auto=False)  # the bundle's ceiling: BeamRunner.run
        v = self.draft_width
        if v is not None and (not is_int(v) or not 1 <= v <= MAX_BEAMS * 2):
            raise InputError(f"draft_width={v!r}: expected an integer 1..{MAX_BEAMS * 2} or None")
        # the rest (early_stopping, num_return_sequences, max_new_tokens) as BeamConfig checks them
        object.__setattr__(self, "stop_token_ids", self.request_params.stop_token_ids)
        self.config(())

    @property
    def request_params(self) -> SamplingParams:
        """What the request's checks take of it (lengths, stop tokens): ``make_request`` builds
        the prompt, the source and the set of tokens that finish a beam from it."""
        return SamplingParams(max_new_tokens=self.max_new_tokens, ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids)

    def config(self, eos: Sequence[int]) -> BeamConfig:
        """The search's semantics, with ``eos``: the tokens that finish a beam."""
        return BeamConfig(int(self.num_beams), int(self.max_new_tokens), float(self.length_penalty), self.early_stopping,
                          int(self.num_return_sequences), tuple(sorted(set(eos))))  # fmt: skip

    @classmethod
    def of(cls, **given) -> BeamParams:
        known = [f.name for f in fields(cls)]
        for name, value in given.items():
            if name not in known:
                raise InputError(f"{name}={value!r}: not a beam search field; expected one of {', '.join(known)}")
        return cls(**given)

    @classmethod
    def from_generate(cls, given: dict) -> BeamParams:
        """From ``generate(num_beams=w, **fields)`` as a Hugging Face user writes it: its
        ``do_sample=False`` is accepted (beam search here is deterministic), ``do_sample=True``
        (beam sampling) is refused by name."""
        given = dict(given)
        if given.pop("do_sample", False):
            raise InputError(f"do_sample=True with num_beams={given.get('num_beams')!r}: beam sampling is not supported; "
                             "drop do_sample for beam search, or num_beams for sampling")
        return cls.of(**given)

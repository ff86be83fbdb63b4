"""One frozen value for what a caller asks of a request besides its input: ``SamplingParams``.

Declared once here; the Python API, the CLI and the server build one and pass it whole
(``BatchEngine.submit(prompt, params)``, ``SpeculativeDecoder.generate(prompt, **fields)``).
A field is checked here when its bound does not depend on the bundle; ``Request`` checks the
rest (γ against the verify graph's K, lengths against max-seq-len, ids against the vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np

from specdec.errors import InputError
from specdec.runtime.logprobs import MAX_LOGPROBS
from specdec.runtime.sampling import SamplingConfig
from specdec.runtime.speculative import check_lenience


def is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request decodes.

    ``gamma``: draft tokens per target call, 0..the bundle's γ, None for the bundle's γ, or
    "auto" to choose it each iteration (§3.5). ``lenience``: 1 is exact; l < 1 accepts more
    drafts and changes the output distribution (no token above p(x) / l; App. A.5).
    ``stop_token_ids``: tokens that end the request besides EOS (``ignore_eos`` drops only EOS),
    as vLLM's field. ``logprobs`` / ``prompt_logprobs``: the target's log-probability of each
    generated / prompt token with that many most likely alternatives (0: the token's own only;
    None: not computed), from the raw logits (runtime/logprobs.py).
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

    def __post_init__(self) -> None:
        SamplingConfig(self.temperature, self.top_k, self.top_p)  # raises SamplingError on a bad value
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

    @classmethod
    def of(cls, **given) -> SamplingParams:
        """From keyword fields, as ``generate(**fields)`` passes them: an unknown name is an
        ``InputError`` naming it (a sampling field is never ignored, nor a TypeError)."""
        known = [f.name for f in fields(cls)]
        for name, value in given.items():
            if name not in known:
                hint = "; it is benchmark-only: specdec bench --synthetic-acceptance" if name == "synthetic_acceptance" else ""
                raise InputError(f"{name}={value!r}: not a request field{hint}; expected one of {', '.join(known)}")
        return cls(**given)

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

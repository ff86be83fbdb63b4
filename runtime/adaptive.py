"""Adaptive γ (paper §3.5): choose each iteration's γ from α and c measured in this request.

α is estimated from decayed counts of accepted and rejected draft tokens: with i.i.d.
acceptances a verify call that drafted k tokens and kept n shows n successes and, when
n < k, one failure, so α̂ = successes / (successes + failures) is the maximum-likelihood
estimate. c is the decayed mean time of one draft call over one verify call (Theorem 3.8
with costs relative to the verify call; v is folded in). γ = ``optimal_gamma(α̂, ĉ)``
within the bundle's K; 0 (plain decoding, the α <= c regime) is re-probed with γ = 1 every
``probe_every`` iterations so a request can recover when the text becomes predictable.
"""

from __future__ import annotations

from specdec.runtime.analysis import optimal_gamma


class AdaptiveGamma:
    """Per-request state; ``next()`` gives the γ to draft now, ``update`` feeds back one iteration."""

    def __init__(self, max_gamma: int, start: int, decay: float = 0.9, probe_every: int = 8, prior: tuple[float, float] = (1.0, 1.0)):
        self.max_gamma, self.decay, self.probe_every = max_gamma, decay, probe_every
        self.gamma = start  # until both costs have been seen once
        self.successes, self.failures = prior  # a weak prior: α̂ = 0.5
        self.draft_call = None  # seconds, decayed mean
        self.verify_call = None
        self.plain_run = 0

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    @property
    def alpha(self) -> float:
        return self.successes / (self.successes + self.failures)

    def next(self) -> int:
        if self.gamma == 0:
            self.plain_run += 1
            if self.plain_run >= self.probe_every:
                self.plain_run = 0
                return 1
        return self.gamma

    def update(self, drafted: int, accepted: int, draft_calls: int, draft_seconds: float, verify_seconds: float) -> None:
        """One verify call: ``drafted`` proposed, ``accepted`` kept, with the time each side took."""
        if drafted == 0:
            return
        d = self.decay
        self.successes = d * self.successes + accepted
        self.failures = d * self.failures + (accepted < drafted)
        if draft_calls:
            self.draft_call = self._mean(self.draft_call, draft_seconds / draft_calls)
        self.verify_call = self._mean(self.verify_call, verify_seconds)
        c = (self.draft_call or 0.0) / self.verify_call if self.verify_call > 0 else 0.0
        alpha = min(max(self.alpha, 1e-6), 1 - 1e-6)
        self.gamma = optimal_gamma(alpha, c, self.max_gamma)

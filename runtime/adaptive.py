"""Adaptive γ (paper §3.5): choose each iteration's γ from the acceptance rate and costs measured online.

- α: decayed counts of accepted and rejected draft tokens. With i.i.d. acceptances a verify
  call that drafted k tokens and kept n shows n successes and, when n < k, one failure, so
  successes / (successes + failures) is the maximum-likelihood estimate.
- Costs: a decayed mean time per draft call, and per k a decayed mean time of a target call
  that verifies k tokens, t(k) (on a CPU a verify call costs more than a 1-token step: the
  paper's v > 1; a plain step is t(0)). For a k not seen yet, t(k) comes from a decayed
  least-squares line a + b·k through every call. The times are not linear in k (the static K
  graph and the dynamic one differ, and caches), so measured values win where there are any.
- γ maximizes expected tokens per second, E[tokens](α, γ) / (γ·t_draft + t(γ)) (Theorem 3.8 in
  seconds), against 1 / t(0) for plain decoding; γ = 0 when speculation cannot pay (α <= c).
  A γ of 0 is re-probed with γ = 1 every ``probe_every`` iterations, so decoding can recover
  when the text becomes predictable.

The decoder keeps one policy per sampling setting and carries it from request to request
(a fork starts afresh): every iteration updates it, so it follows a request's text, while the
long memory (``decay`` 0.99 per iteration, about a hundred iterations) keeps one request's
first noisy iterations from driving γ (α̂ from a few short calls is noisy, and the choice then
sticks at a small γ). The first call of each k (and the first draft call) is not timed: the
first run of a graph is cold. A fresh policy opens with the bundle's γ, γ = 1, and both
again, so the cost line has two timed points. The measurements behind these choices are in
``docs/bench/notes.md``.
"""

from __future__ import annotations

import math
from typing import Sequence

from specdec.runtime.analysis import expected_tokens
from specdec.runtime.stats import Iteration

# Timing noise is one-sided (a preempted call is slow, none is fast): a sample above SPIKE x the
# running mean counts as SPIKE x the mean, so one interrupted call cannot swing γ.
SPIKE = 1.5


class Acceptance:
    """Decayed counts of accepted and rejected drafts; ``alpha`` is their maximum-likelihood α.
    Policies that share one (the batch engine's, one per graph) pool what they see."""

    def __init__(self, decay: float = 0.99):
        self.decay = decay
        self.successes, self.failures = 1.0, 1.0  # a weak prior: α̂ = 0.5

    def observe(self, drafted: int, accepted: int) -> None:
        self.successes = self.decay * self.successes + accepted
        self.failures = self.decay * self.failures + (accepted < drafted)

    @property
    def alpha(self) -> float:
        return self.successes / (self.successes + self.failures)


class AdaptiveGamma:
    """``next()`` gives the γ to draft now, ``update`` feeds back one iteration."""

    def __init__(self, max_gamma: int, decay: float = 0.99, probe_every: int = 8, acceptance: Acceptance | None = None):
        self.max_gamma, self.decay, self.probe_every = max_gamma, decay, probe_every
        self.plan = [max_gamma, 1] * 2 if max_gamma > 1 else [max_gamma] * 2  # the opening moves
        self.gamma = max_gamma
        self.acceptance = acceptance or Acceptance(decay)
        self.draft_call: float | None = None  # seconds per draft call, decayed mean
        self.fit = [0.0] * 5  # decayed sums of w, k, k², t, k·t for t(k) = a + b·k
        self.times = [math.nan] * (max_gamma + 1)  # decayed mean seconds of a call verifying k tokens
        self.calls = [0] * (max_gamma + 1)  # target calls seen per k
        self.draft_seen = False
        self.plain_run = 0

    @property
    def alpha(self) -> float:
        return self.acceptance.alpha

    def target_time(self, k: int) -> float:
        """t(k): measured when a call of k tokens was seen, else from the line (flat until two
        different k have been seen)."""
        if not math.isnan(self.times[k]):
            return self.times[k]
        w, sk, skk, st, skt = self.fit
        var = w * skk - sk * sk
        b = max((w * skt - sk * st) / var, 0.0) if var > 1e-12 * max(w * skk, 1e-30) else 0.0
        return (st - b * sk) / w + b * k

    def next(self) -> int:
        if self.plan:
            return self.plan.pop(0)
        if self.gamma == 0:
            self.plain_run += 1
            if self.plain_run >= self.probe_every:
                self.plain_run = 0
                return 1
        return self.gamma

    def update(self, it: Iteration) -> None:
        """Feed back one iteration: k drafted (0: a plain step), n kept, and the time each side took."""
        self.observe((it.drafted,), (it.accepted,), it.draft_calls, it.draft_seconds, it.target_seconds)

    def observe(self, drafted: Sequence[int], accepted: Sequence[int], draft_calls: int, draft_seconds: float, target_seconds: float) -> None:
        """Feed back one iteration of one or more rows (a batched call): per row k drafted and n
        kept; the call is timed as a call of the widest row's k."""
        width = max(drafted)
        self._time_target(width, target_seconds)
        d = self.decay
        for k, n in zip(drafted, accepted):
            if k:
                self.acceptance.observe(k, n)
        if width and draft_calls and not self.draft_seen:
            self.draft_seen = True  # skip the first, cold, draft calls too
        elif width and draft_calls:
            per = draft_seconds / draft_calls
            self.draft_call = per if self.draft_call is None else d * self.draft_call + (1 - d) * min(per, SPIKE * self.draft_call)
        if self.draft_call is not None and self.fit[0] > 0:
            self.gamma = self._best()

    def _time_target(self, k: int, seconds: float) -> None:
        d = self.decay
        self.calls[k] += 1
        if self.calls[k] > 1:  # the first call of a graph is cold (docs/bench/notes.md)
            self.fit = [d * s + x for s, x in zip(self.fit, (1.0, k, k * k, seconds, k * seconds))]
            old = self.times[k]
            self.times[k] = seconds if math.isnan(old) else 0.8 * old + 0.2 * min(seconds, SPIKE * old)

    def _best(self) -> int:
        """The γ with the most expected tokens per second (0: plain decoding)."""
        alpha = min(self.alpha, 1 - 1e-9)
        best, rate = 0, 1.0 / self.target_time(0)
        for g in range(1, self.max_gamma + 1):
            r = expected_tokens(alpha, g) / (g * self.draft_call + self.target_time(g))
            if r > rate:
                best, rate = g, r
        return best

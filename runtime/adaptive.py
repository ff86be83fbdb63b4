"""Adaptive γ (paper §3.5): choose each iteration's γ from the acceptance rate and costs measured online.

- α: decayed counts of accepted and rejected draft tokens. With i.i.d. acceptances a verify
  call that drafted k tokens and kept n shows n successes and, when n < k, one failure, so
  successes / (successes + failures) is the maximum-likelihood estimate. In a batch each row
  keeps its own count too (``Acceptance.fork``), started from the pooled one.
- Costs: per k, T(k), a decayed mean of the whole iteration's seconds at width k: drafting k
  tokens, the target's call over the rows, acceptance and emission, everything the loop pays
  per iteration (a plain step is T(0)). Timing the target call alone missed the loop's own
  per-iteration work, which on a small model is a large share and favours larger γ (fewer
  iterations per token): adaptive then chose γ 3 where γ 4 ran 20% faster. For a k not seen
  yet, T(k) comes from a decayed least-squares line a + b·k through every iteration. The times
  are not linear in k (the static K graph and the dynamic one differ, and caches), so measured
  values win where there are any. The engine keeps one policy per batch size (rows per call).
- γ maximizes expected tokens per second of the call, Σ_r E[tokens](α_r, γ) / T(γ) over its
  rows (Theorem 3.8 in seconds, summed: rows are padded to the widest, so all verify γ), against
  rows / T(0) for plain decoding; γ = 0 when speculation cannot pay. A γ of 0 is re-probed with
  γ = 1 every ``probe_every`` iterations, so decoding can recover when the text becomes predictable.

The engine keeps one policy per batch size and sampling setting and carries it from request to
request (a fork starts afresh): every iteration updates it, so it follows the text, while the
long memory (``decay`` 0.99 per iteration, about a hundred iterations) keeps one request's
first noisy iterations from driving γ (α̂ from a few short calls is noisy, and the choice then
sticks at a small γ). The first iteration of each k is not timed: the first run of a graph is
cold. A fresh policy opens with the bundle's γ, γ = 1, and both again, so the cost line has two
timed points. The measurements behind these choices are in ``docs/bench/notes.md``.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from specdec.runtime.stats import Iteration

# Timing noise is one-sided (a preempted call is slow, none is fast): a sample above SPIKE x the
# running mean counts as SPIKE x the mean, so one interrupted call cannot swing γ.
SPIKE = 1.5


class Acceptance:
    """Decayed counts of accepted and rejected drafts; ``alpha`` is their maximum-likelihood α.
    Per draft position i also the calls that tested it (kept 1..i-1) and those that kept it:
    ``expected(γ)`` reads tokens per call from them, where Eq. 1 at the i.i.d. α misreads
    acceptances that come in stretches (a predictable span keeps every draft, and its many
    successes inflate α; tests/runtime/test_drafters.py). Policies that share one (the batch
    engine's, one per graph) pool what they see."""

    PRIOR = 2.0  # pseudo-calls at α given to each position's rate, so a position seldom tested reads about α

    def __init__(self, decay: float = 0.99, depth: int = 16):
        self.decay = decay
        self.successes, self.failures = 1.0, 1.0  # a weak prior: α̂ = 0.5
        self.tested = np.zeros(depth)  # [depth] decayed calls that tested position i + 1
        self.kept = np.zeros(depth)  # [depth] of them, calls that kept it

    def observe(self, drafted: int, accepted: int) -> None:
        d = self.decay
        self.successes = d * self.successes + accepted
        self.failures = d * self.failures + (accepted < drafted)
        self.tested *= d
        self.kept *= d
        reach = min(accepted + 1, drafted, len(self.tested))
        self.tested[:reach] += 1
        self.kept[: min(accepted, reach)] += 1

    @property
    def alpha(self) -> float:
        return self.successes / (self.successes + self.failures)

    def curve(self, gamma: int) -> np.ndarray:
        """[gamma + 1] E[tokens] of a call drafting 0..``gamma``: 1 + Σ_{i<=g} P(drafts 1..i kept),
        each position's rate its own count shrunk toward α (positions past ``depth``: α)."""
        a = min(self.alpha, 1 - 1e-9)
        rates = np.full(gamma, a)
        n = min(gamma, len(self.tested))
        rates[:n] = (self.kept[:n] + self.PRIOR * a) / (self.tested[:n] + self.PRIOR)
        return np.concatenate(([1.0], 1.0 + np.cumsum(np.cumprod(rates))))

    def expected(self, gamma: int) -> float:
        """E[tokens] of a call drafting ``gamma`` (``curve``'s last)."""
        return float(self.curve(gamma)[-1])

    def fork(self, weight: float = 8.0) -> Acceptance:
        """A row's own count, starting from this pooled one as a prior worth ``weight`` calls:
        a joining row starts at what its setting has seen, then follows its own text."""
        row = Acceptance(self.decay, len(self.tested))
        scale = weight / max(self.successes + self.failures, 1e-9)
        row.successes, row.failures = scale * self.successes, scale * self.failures
        first = max(self.tested[0], 1e-9)
        row.tested, row.kept = self.tested * (weight / first), self.kept * (weight / first)
        return row


class AdaptiveGamma:
    """``next()`` gives the γ to draft now, ``update`` feeds back one iteration."""

    def __init__(self, max_gamma: int, decay: float = 0.99, probe_every: int = 8, acceptance: Acceptance | None = None):
        self.max_gamma, self.decay, self.probe_every = max_gamma, decay, probe_every
        self.plan = [max_gamma, 1] * 2 if max_gamma > 1 else [max_gamma] * 2  # the opening moves
        self.gamma = max_gamma
        self.acceptance = acceptance or Acceptance(decay)
        self.fit = [0.0] * 5  # decayed sums of w, k, k², T, k·T for T(k) = a + b·k
        self.times = [math.nan] * (max_gamma + 1)  # decayed mean seconds of an iteration at width k
        self.calls = [0] * (max_gamma + 1)  # iterations seen per k
        self.plain_run = 0

    @property
    def alpha(self) -> float:
        return self.acceptance.alpha

    def target_time(self, k: int) -> float:
        """T(k): measured when an iteration of width k was seen, else from the line (flat until
        two different k have been seen)."""
        if not math.isnan(self.times[k]):
            return self.times[k]
        w, sk, skk, st, skt = self.fit
        var = w * skk - sk * sk
        b = max((w * skt - sk * st) / var, 0.0) if var > 1e-12 * max(w * skk, 1e-30) else 0.0
        return (st - b * sk) / w + b * k

    def next(self, rows: Sequence[Acceptance] | None = None) -> int:
        """γ for the next call; ``rows``: each row's own acceptance in a batched call (None: the
        pooled one's choice), so the call's γ maximizes the batch's tokens per second (``best``)."""
        if self.plan:
            return self.plan.pop(0)
        if self.fit[0] > 0:  # chosen here, once an iteration, from what the last ones measured
            self.gamma = self.best(rows if rows is not None and len(rows) > 1 else [self.acceptance])
        if self.gamma == 0:
            self.plain_run += 1
            if self.plain_run >= self.probe_every:
                self.plain_run = 0
                return 1
        return self.gamma

    def update(self, it: Iteration) -> None:
        """Feed back one iteration of one row, timed as its drafting, target call and acceptance."""
        self.observe((it.drafted,), (it.accepted,), it.draft_seconds + it.target_seconds + it.accept_seconds)

    def observe(self, drafted: Sequence[int], accepted: Sequence[int], seconds: float) -> None:
        """Feed back one iteration of one or more rows (a batched call): per row k drafted (0: a
        plain step) and n kept; ``seconds``: the whole iteration, timed as one of the widest row's k."""
        self._time_target(max(drafted), seconds)
        for k, n in zip(drafted, accepted):
            if k:
                self.acceptance.observe(k, n)

    def _time_target(self, k: int, seconds: float) -> None:
        d = self.decay
        self.calls[k] += 1
        if self.calls[k] > 1:  # the first call of a graph is cold (docs/bench/notes.md)
            if self.fit[0] > 0:  # a preempted iteration counts as SPIKE x what was expected of it: never as the first sample of a k that then is never chosen again
                seconds = min(seconds, SPIKE * self.target_time(k))
            self.fit = [d * s + x for s, x in zip(self.fit, (1.0, k, k * k, seconds, k * seconds))]
            old = self.times[k]
            self.times[k] = seconds if math.isnan(old) else 0.8 * old + 0.2 * seconds

    def best(self, rows: Sequence[Acceptance]) -> int:
        """The γ with the most expected tokens per second for a call of these rows (0: plain
        decoding). Rows are padded to the call's widest, so every row of it verifies γ and the
        iteration costs T(γ) however few a row would want: the rate is Σ_r E_r[tokens](γ) over
        T(γ), against rows / T(0) plain (Theorem 3.8 summed over the batch's rows)."""
        tokens = sum(a.curve(self.max_gamma) for a in rows)  # [max_gamma + 1]; at γ = 0 one a row
        rates = tokens / np.array([self.target_time(g) for g in range(self.max_gamma + 1)])
        return int(np.argmax(rates))  # ties: the smaller γ

"""One interleaved sweep: drafters and γ against γ = 0 on the same prompts, summed and summarized.

Every configuration (a drafter at a fixed γ, or adaptive γ) decodes the same prompts in
interleaved rounds, so machine noise hits all alike. Per configuration: tokens/s, the speedup
over γ = 0, α (the maximum-likelihood estimate from accepted and rejected drafts), the measured
cost c (draft time per drafted token / 1-token target call) and v (verify call / 1-token target
call), and, for a fixed γ, Theorem 3.8's prediction E[tokens] / (γc + v) from those, like the
paper's Table 4.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import zip_longest
from typing import NamedTuple

from specdec.runtime.analysis import expected_tokens, optimal_gamma
from specdec.runtime.drafters import needs_tree
from specdec.rounds import interleaved
from specdec.runtime.stats import COUNTERS


@dataclass
class Tally:
    """Sums over every request of one configuration: decode seconds and tokens, each
    ``stats.COUNTERS`` entry (as attributes), and the per-position counts."""

    seconds: float = 0.0
    tokens: int = 0
    accepted_at: list[int] = field(default_factory=list)
    drafted_at: list[int] = field(default_factory=list)
    kept_rank: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for k in COUNTERS:
            setattr(self, k, 0)

    def add(self, s) -> None:
        self.seconds += s.total_seconds - s.prefill_seconds
        self.tokens += s.new_tokens
        for k in COUNTERS:
            setattr(self, k, getattr(self, k) + getattr(s, k))
        if not self.accepted_at:
            self.accepted_at, self.drafted_at = [0] * s.gamma, [0] * s.gamma
        self.accepted_at = [a + b for a, b in zip(self.accepted_at, s.accepted_at)]
        self.drafted_at = [a + b for a, b in zip(self.drafted_at, s.drafted_at)]
        self.kept_rank = [a + b for a, b in zip_longest(self.kept_rank, s.kept_rank, fillvalue=0)]


class Config(NamedTuple):
    """One benchmarked configuration: a drafter and a γ (an int, or "auto" for adaptive γ)."""

    drafter: str
    gamma: int | str

    @property
    def label(self) -> str:
        return "autoregressive" if self.gamma == 0 else f"{self.drafter} γ={self.gamma}"


def configs(drafters: list[str], gammas: list[int], adaptive: bool) -> list[Config]:
    """γ = 0 once (it is the same for every drafter), then each drafter at each γ (and "auto")."""
    out = [Config(drafters[0], 0)]
    for d in drafters:
        out += [Config(d, g) for g in gammas if g] + ([Config(d, "auto")] if adaptive else [])
    return out


def run(decoders: dict, cfgs: list[Config], prompts: list[list[int]], tokens: int, rounds: int, temperature: float,
        ignore_eos: bool = True) -> dict[Config, Tally]:  # fmt: skip
    """Interleaved rounds: each round, every prompt is decoded once by every configuration
    (seeded); ``decoders`` maps a drafter name to a decoder using it. ``ignore_eos=False``
    (encoder-decoder tasks, whose output ends): requests stop at EOS or ``tokens``."""
    tallies = {c: Tally() for c in cfgs}

    def go(c: Config, prompt, n: int, seed: int):
        return decoders[c.drafter].generate(prompt, max_new_tokens=n, gamma=c.gamma, temperature=temperature, seed=seed, ignore_eos=ignore_eos)

    for c in cfgs:  # warm-up: first calls pay for lazy initialisation
        go(c, prompts[0], 8, 0)
    for r, (i, c) in interleaved([(i, c) for i in range(len(prompts)) for c in cfgs], rounds):
        tallies[c].add(go(c, prompts[i], tokens, 1000 * r + i).stats)
    return tallies


def alpha_mle(accepted: int, rejected: int) -> float:
    """α from i.i.d. acceptances: each drafted token reached is a trial, each call ending in a
    rejection one failure; successes / trials is the maximum-likelihood estimate, and it holds
    for proposals of any length (prompt lookup, adaptive γ)."""
    trials = accepted + rejected
    return accepted / trials if trials else 0.0


@dataclass(frozen=True)
class Row:
    drafter: str
    gamma: int | str
    tokens_per_s: float
    speedup: float
    engine_share: float  # time inside the two engines / decode time
    alpha: float | None = None
    c: float | None = None  # draft time per drafted token / one 1-token target call
    v: float | None = None
    predicted: float | None = None  # fixed γ only: proposals of varying length have no closed form here
    per_position: tuple[float, ...] = ()
    mean_proposed: float | None = None  # drafted tokens per verify call
    ms_per_token: float | None = None
    floor_ratio: float | None = None  # decode time / the bandwidth floor of the calls it made (floor.py)
    tokens_per_call: float | None = None  # new tokens per decoding target call (accepted + the target's own)
    rank_acceptance: tuple[float, ...] = ()  # per sibling rank: kept share of tested positions (stats.Stats)
    tokens: int = 0  # new tokens over every request (requests that end at EOS may differ per configuration at T > 0)


def summarize(tallies: dict[Config, Tally], floor=None) -> list[Row]:
    """Rows per configuration; costs are relative to γ = 0's mean 1-token target call (which must be present).
    ``floor``: a ``floor.Floor``, to set each row's time against the bandwidth floor of its calls."""
    base = next(t for c, t in tallies.items() if c.gamma == 0)
    step = base.target_seconds / base.target_calls
    base_tps = base.tokens / base.seconds
    rows = []
    for cfg, t in tallies.items():
        tps = t.tokens / t.seconds
        share = (t.target_seconds + t.draft_seconds) / t.seconds
        timing = {"ms_per_token": 1e3 / tps, "floor_ratio": t.seconds / floor.seconds(t.target_calls, t.draft_calls) if floor else None, "tokens": t.tokens}
        if cfg.gamma == 0:
            rows.append(Row("-", 0, tps, 1.0, share, **timing))
            continue
        alpha = alpha_mle(t.accepted, t.rejected)
        c = (t.draft_seconds / t.drafted) / step if t.drafted else 0.0
        v = (t.target_seconds / t.target_calls) / step
        per = tuple(a / d if d else 0.0 for a, d in zip(t.accepted_at, t.drafted_at))
        ranks = tuple(n / t.positions_tested for n in t.kept_rank) if t.positions_tested else ()
        fixed = isinstance(cfg.gamma, int) and cfg.drafter != "lookup" and not needs_tree(cfg.drafter)  # trees: plan_trees
        predicted = expected_tokens(alpha, cfg.gamma) / (cfg.gamma * c + v) if fixed else None
        mean = t.drafted / t.verify_calls if t.verify_calls else 0.0
        rows.append(Row(cfg.drafter, cfg.gamma, tps, tps / base_tps, share, alpha, c, v, predicted, per, mean, **timing,
                        tokens_per_call=t.tokens / t.target_calls if t.target_calls else None, rank_acceptance=ranks))
    return rows


def planned_gamma(rows: list[Row], max_gamma: int, drafter: str = "model") -> int | None:
    """The planner's γ from the α, c and v measured at the drafter's largest fixed γ run."""
    fixed = [r for r in rows if r.drafter == drafter and isinstance(r.gamma, int) and r.gamma]
    if not fixed:
        return None
    r = max(fixed, key=lambda r: r.gamma)
    return optimal_gamma(min(max(r.alpha, 1e-6), 1 - 1e-6), r.c, max_gamma, verify_cost=r.v)

"""Counters of one generation request, and the figures derived from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


# The counters a request adds up, and a benchmark sums over requests (``bench.Tally``).
COUNTERS = (
    "target_calls", "draft_calls", "verify_calls", "drafted", "accepted", "rejected",
    "target_seconds", "draft_seconds", "accept_seconds", "positions_tested",
)


class Iteration(NamedTuple):
    """What one iteration of the loop did: drafted k, the target kept n, and where the time went."""

    drafted: int  # k: draft tokens verified (0: a plain target step)
    accepted: int  # n: of them kept
    draft_calls: int
    draft_seconds: float
    target_seconds: float
    accept_seconds: float
    ranks: tuple[int, ...] | None = None  # a tree's kept nodes' sibling ranks (None: a chain, all 0)
    tested: int | None = None  # positions where candidates were tested (None: a chain's min(n + 1, k))


@dataclass
class Stats:
    """What one request did and where its time went.

    ``target_calls`` and ``draft_calls`` count decode calls (prefill is counted apart);
    ``drafted_at[i]`` / ``accepted_at[i]`` count draft tokens at position i+1 of a verify call;
    ``kept_rank[k]`` counts kept draft tokens that were their position's rank-k candidate (a
    tree's siblings; a chain keeps rank 0 only) out of ``positions_tested``.
    """

    gamma: int  # the most draft tokens per call (the ceiling when adaptive)
    prompt_tokens: int = 0
    drafter: str = "model"
    adaptive: bool = False
    lenience: float = 1.0  # below 1 the output distribution is NOT the target's (App. A.5)
    synthetic: float | None = None  # benchmarks only: drafts kept with this probability, output NOT the target's
    threads: str = ""  # the ONNX Runtime thread policy (engines.threads.ThreadPolicy.label)
    new_tokens: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    verify_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # verify calls that ended at a rejected draft token
    prefill_seconds: float = 0.0
    target_seconds: float = 0.0
    draft_seconds: float = 0.0
    accept_seconds: float = 0.0
    total_seconds: float = 0.0
    finish_reason: str | None = None  # "eos" or "length"
    grammar_seconds: float = 0.0  # structured outputs: time in the grammar (masks, matcher steps), part of the other times
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    kept_rank: list[int] = field(default_factory=list)
    positions_tested: int = 0

    def __post_init__(self) -> None:
        self.drafted_at = [0] * self.gamma
        self.accepted_at = [0] * self.gamma

    def record(self, it: Iteration) -> None:
        """Add one iteration's counts and times."""
        k, n = it.drafted, it.accepted
        self.target_calls += 1
        self.draft_calls += it.draft_calls
        self.draft_seconds += it.draft_seconds
        self.target_seconds += it.target_seconds
        self.accept_seconds += it.accept_seconds
        if k:
            self.verify_calls += 1
            self.drafted += k
            self.accepted += n
            self.rejected += n < k
            if k > len(self.drafted_at):  # a grammar's forced span may pass the request's γ
                grow = [0] * (k - len(self.drafted_at))
                self.drafted_at, self.accepted_at = self.drafted_at + grow, self.accepted_at + grow
            for i in range(k):
                self.drafted_at[i] += 1
                self.accepted_at[i] += i < n
            self.positions_tested += min(n + 1, k) if it.tested is None else it.tested
            for rank in (0,) * n if it.ranks is None else it.ranks:
                self.kept_rank.extend([0] * (rank + 1 - len(self.kept_rank)))
                self.kept_rank[rank] += 1

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens (an empirical lower view of the paper's α)."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted(self) -> float | None:
        """Draft tokens accepted per verify call; tokens per target call is this + 1."""
        return self.accepted / self.verify_calls if self.verify_calls else None

    @property
    def per_position_acceptance(self) -> list[float | None]:
        """Per position i = 1..γ: of the verify calls that drafted a token i, the share that kept
        it (which needs tokens 1..i-1 kept too): P(first i drafts all accepted)."""
        return [a / d if d else None for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def rank_acceptance(self) -> list[float]:
        """Per sibling rank k: of the positions where candidates were tested, the share that kept
        the rank-k candidate (``specdec plan --rank-acceptance``; a chain's [0] is its α)."""
        return [n / self.positions_tested for n in self.kept_rank] if self.positions_tested else []

    @property
    def cost_coefficient(self) -> float | None:
        """Measured c: mean draft call time / mean target call time."""
        if not (self.draft_calls and self.target_calls and self.target_seconds > 0):
            return None
        return (self.draft_seconds / self.draft_calls) / (self.target_seconds / self.target_calls)

    @property
    def tokens_per_second(self) -> float | None:
        """New tokens per second of decoding (prefill excluded)."""
        decode = self.total_seconds - self.prefill_seconds
        return self.new_tokens / decode if decode > 0 else None

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        for k in ("acceptance_rate", "mean_accepted", "per_position_acceptance", "rank_acceptance", "cost_coefficient", "tokens_per_second"):
            d[k] = getattr(self, k)
        d["exact"] = self.lenience >= 1.0 and self.synthetic is None
        return d

    def line(self) -> str:
        """One human line for stderr."""

        def f(x, fmt):
            return "-" if x is None else format(x, fmt)

        return (
            f"{self.new_tokens} tokens in {self.total_seconds:.3f}s ({f(self.tokens_per_second, '.1f')} tok/s, "
            f"prefill {self.prefill_seconds:.3f}s); gamma={self.gamma}, target calls {self.target_calls}, "
            f"draft calls {self.draft_calls}, accepted {self.accepted}/{self.drafted} "
            f"(rate {f(self.acceptance_rate, '.3f')}, mean {f(self.mean_accepted, '.2f')}/call), "
            f"c={f(self.cost_coefficient, '.3f')}, drafter={self.drafter}{' (adaptive gamma)' if self.adaptive else ''}, "
            f"threads {self.threads or '-'}, stop={self.finish_reason}{self.lenience_warning}"
        )

    @property
    def lenience_warning(self) -> str:
        """Empty when exact; else says the distribution changed and what still holds."""
        if self.synthetic is not None:
            return f"; SYNTHETIC acceptance {self.synthetic:g} (benchmark only): output is NOT the target's"
        if self.lenience >= 1.0:
            return ""
        return (
            f"; LENIENCE {self.lenience:g}: output is NOT distributed as the target's; "
            f"no token is sampled with more than {1 / self.lenience:.3g}x its target probability "
            f"(greedy: a draft token is kept when its probability is >= {self.lenience:g} x the top one's)"
        )

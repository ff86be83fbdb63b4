"""Side-by-side decoding benchmark of one bundle: speculative at several γ against γ = 0.

Every γ decodes the same prompts in interleaved rounds, so machine noise hits all alike.
Per γ it reports tokens/s, the speedup over γ = 0, the α that explains the measured accepted
length, the measured cost c (draft call / 1-token target call) and v (verify call / 1-token
target call), and Theorem 3.8's prediction E[tokens] / (γc + v) from those, like the paper's
Table 4. Runtime only: NumPy, ONNX Runtime, tokenizers.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdec.runtime.analysis import expected_tokens, optimal_gamma

EXCLUDED = {"site-packages", "test", "tests", "idle_test"}


def stdlib_files(held_out: bool) -> list[Path]:
    """CPython stdlib ``.py`` files (no site-packages, no test packages), split by file: a file
    is held out when the sha256 of its relative path is 0 mod 20 (the demo pair's split)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for f in sorted(stdlib.rglob("*.py")):
        rel = f.relative_to(stdlib)
        if EXCLUDED & set(rel.parts):
            continue
        if (int(hashlib.sha256(str(rel).encode()).hexdigest(), 16) % 20 == 0) == held_out:
            out.append(f)
    return out


def held_out_prompts(encode, count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens: the opening of held-out files long enough."""
    prompts = []
    for f in stdlib_files(held_out=True):
        ids = encode(f.read_text(encoding="utf-8", errors="replace"))
        if len(ids) >= length * 2:
            prompts.append(ids[:length])
        if len(prompts) == count:
            break
    return prompts


@dataclass
class Tally:
    """Sums over every request of one γ."""

    seconds: float = 0.0
    tokens: int = 0
    target_seconds: float = 0.0
    target_calls: int = 0
    draft_seconds: float = 0.0
    draft_calls: int = 0
    verify_calls: int = 0
    accepted: int = 0
    accept_seconds: float = 0.0
    accepted_at: list[int] = field(default_factory=list)
    drafted_at: list[int] = field(default_factory=list)

    def add(self, s) -> None:
        self.seconds += s.total_seconds - s.prefill_seconds
        self.tokens += s.new_tokens
        self.target_seconds += s.target_seconds
        self.target_calls += s.target_calls
        self.draft_seconds += s.draft_seconds
        self.draft_calls += s.draft_calls
        self.verify_calls += s.verify_calls
        self.accepted += s.accepted
        self.accept_seconds += s.accept_seconds
        if not self.accepted_at:
            self.accepted_at, self.drafted_at = [0] * s.gamma, [0] * s.gamma
        self.accepted_at = [a + b for a, b in zip(self.accepted_at, s.accepted_at)]
        self.drafted_at = [a + b for a, b in zip(self.drafted_at, s.drafted_at)]


def run(dec, prompts: list[list[int]], gammas: list[int], tokens: int, rounds: int, temperature: float) -> dict[int, Tally]:
    """Interleaved rounds: each round, every prompt is decoded once by every γ (seeded)."""
    tallies = {g: Tally() for g in gammas}
    for g in gammas:  # warm-up: first calls pay for lazy initialisation
        dec.generate(prompts[0], max_new_tokens=8, gamma=g, temperature=temperature, seed=0, ignore_eos=True)
    for r in range(rounds):
        for i, prompt in enumerate(prompts):
            for g in gammas:
                res = dec.generate(prompt, max_new_tokens=tokens, gamma=g, temperature=temperature, seed=1000 * r + i, ignore_eos=True)
                tallies[g].add(res.stats)
    return tallies


def alpha_from_mean(mean_accepted: float, gamma: int) -> float:
    """The α whose i.i.d. acceptances give ``mean_accepted`` = α + α² + … + α^γ per call."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a**i for i in range(1, gamma + 1)) < mean_accepted else (lo, a)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Row:
    gamma: int
    tokens_per_s: float
    speedup: float
    engine_share: float  # time inside the two engines / decode time
    alpha: float | None = None
    c: float | None = None
    v: float | None = None
    predicted: float | None = None
    per_position: tuple[float, ...] = ()


def summarize(tallies: dict[int, Tally]) -> list[Row]:
    """Rows per γ; costs are relative to γ = 0's mean 1-token target call (which must be present)."""
    base = tallies[0]
    step = base.target_seconds / base.target_calls
    base_tps = base.tokens / base.seconds
    rows = []
    for g, t in sorted(tallies.items()):
        tps = t.tokens / t.seconds
        share = (t.target_seconds + t.draft_seconds) / t.seconds
        if g == 0:
            rows.append(Row(0, tps, 1.0, share))
            continue
        alpha = alpha_from_mean(t.accepted / t.verify_calls, g)
        c = (t.draft_seconds / t.draft_calls) / step
        v = (t.target_seconds / t.target_calls) / step
        per = tuple(a / d if d else 0.0 for a, d in zip(t.accepted_at, t.drafted_at))
        rows.append(Row(g, tps, tps / base_tps, share, alpha, c, v, expected_tokens(alpha, g) / (g * c + v), per))
    return rows


def planned_gamma(rows: list[Row], max_gamma: int) -> int:
    """The planner's γ from the α, c and v measured at the largest γ run."""
    r = max((r for r in rows if r.gamma), key=lambda r: r.gamma)
    return optimal_gamma(r.alpha, r.c, max_gamma, verify_cost=r.v)


def markdown(title: str, rows: list[Row]) -> str:
    lines = [f"**{title}**", "",
             "| γ | tok/s | speedup vs γ=0 | predicted E[tokens]/(γc+v) | measured / predicted | α | c | v | time in engines |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.gamma == 0:
            lines.append(f"| 0 | {r.tokens_per_s:.0f} | 1.00 | – | – | – | – | – | {r.engine_share:.0%} |")
        else:
            lines.append(f"| {r.gamma} | {r.tokens_per_s:.0f} | {r.speedup:.2f} | {r.predicted:.2f} | {r.speedup / r.predicted:.2f} | "
                         f"{r.alpha:.3f} | {r.c:.3f} | {r.v:.2f} | {r.engine_share:.0%} |")
    return "\n".join(lines) + "\n"


def as_dict(rows: list[Row]) -> list[dict]:
    return [asdict(r) for r in rows]


def plot(results: dict[str, list[Row]], path: Path) -> None:
    """Speedup against γ (measured and predicted; cf. the paper's Fig. 3) and acceptance per
    draft position, one line per temperature. Needs matplotlib (``pip install 'specdec[bench]'``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for title, rows in results.items():
        spec = [r for r in rows if r.gamma]
        line = a.plot([0] + [r.gamma for r in spec], [1.0] + [r.speedup for r in spec], marker="o", label=f"{title} measured")[0]
        a.plot([r.gamma for r in spec], [r.predicted for r in spec], ls="--", color=line.get_color(), label=f"{title} predicted")
        top = max(spec, key=lambda r: r.gamma)
        b.plot(range(1, len(top.per_position) + 1), top.per_position, marker="o", label=f"{title} (γ={top.gamma})")
    from matplotlib.ticker import MaxNLocator

    for ax in (a, b):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    a.axhline(1.0, color="grey", lw=0.8)
    a.set(xlabel="γ (draft tokens per target call)", ylabel="speedup over γ = 0", title="Walltime improvement")
    b.set(xlabel="draft position i", ylabel="P(accepted | reached)", title="Acceptance per draft position", ylim=(0, 1.05))
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

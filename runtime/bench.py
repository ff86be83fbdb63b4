"""Side-by-side decoding benchmark of one bundle: drafters and γ against γ = 0.

Every configuration (a drafter at a fixed γ, or adaptive γ) decodes the same prompts in
interleaved rounds, so machine noise hits all alike. Per configuration it reports tokens/s,
the speedup over γ = 0, α (the maximum-likelihood estimate from accepted and rejected drafts),
the measured cost c (draft time per drafted token / 1-token target call) and v (verify call /
1-token target call), and, for a fixed γ, Theorem 3.8's prediction E[tokens] / (γc + v) from
those, like the paper's Table 4. Runtime only: NumPy, ONNX Runtime, tokenizers.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

from specdec.runtime.analysis import expected_tokens, optimal_gamma
from specdec.runtime.stats import COUNTERS

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
    """Sums over every request of one configuration: decode seconds and tokens, each
    ``stats.COUNTERS`` entry (as attributes), and the per-position counts."""

    seconds: float = 0.0
    tokens: int = 0
    accepted_at: list[int] = field(default_factory=list)
    drafted_at: list[int] = field(default_factory=list)

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


def run(decoders: dict, cfgs: list[Config], prompts: list[list[int]], tokens: int, rounds: int, temperature: float) -> dict[Config, Tally]:
    """Interleaved rounds: each round, every prompt is decoded once by every configuration
    (seeded); ``decoders`` maps a drafter name to a decoder using it."""
    tallies = {c: Tally() for c in cfgs}

    def go(c: Config, prompt, n: int, seed: int):
        return decoders[c.drafter].generate(prompt, max_new_tokens=n, gamma=c.gamma, temperature=temperature, seed=seed, ignore_eos=True)

    for c in cfgs:  # warm-up: first calls pay for lazy initialisation
        go(c, prompts[0], 8, 0)
    for r in range(rounds):
        for i, prompt in enumerate(prompts):
            for c in cfgs:
                tallies[c].add(go(c, prompt, tokens, 1000 * r + i).stats)
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


def summarize(tallies: dict[Config, Tally]) -> list[Row]:
    """Rows per configuration; costs are relative to γ = 0's mean 1-token target call (which must be present)."""
    base = next(t for c, t in tallies.items() if c.gamma == 0)
    step = base.target_seconds / base.target_calls
    base_tps = base.tokens / base.seconds
    rows = []
    for cfg, t in tallies.items():
        tps = t.tokens / t.seconds
        share = (t.target_seconds + t.draft_seconds) / t.seconds
        if cfg.gamma == 0:
            rows.append(Row("-", 0, tps, 1.0, share))
            continue
        alpha = alpha_mle(t.accepted, t.rejected)
        c = (t.draft_seconds / t.drafted) / step if t.drafted else 0.0
        v = (t.target_seconds / t.target_calls) / step
        per = tuple(a / d if d else 0.0 for a, d in zip(t.accepted_at, t.drafted_at))
        fixed = isinstance(cfg.gamma, int) and cfg.drafter != "lookup"
        predicted = expected_tokens(alpha, cfg.gamma) / (cfg.gamma * c + v) if fixed else None
        mean = t.drafted / t.verify_calls if t.verify_calls else 0.0
        rows.append(Row(cfg.drafter, cfg.gamma, tps, tps / base_tps, share, alpha, c, v, predicted, per, mean))
    return rows


def planned_gamma(rows: list[Row], max_gamma: int, drafter: str = "model") -> int | None:
    """The planner's γ from the α, c and v measured at the drafter's largest fixed γ run."""
    fixed = [r for r in rows if r.drafter == drafter and isinstance(r.gamma, int) and r.gamma]
    if not fixed:
        return None
    r = max(fixed, key=lambda r: r.gamma)
    return optimal_gamma(min(max(r.alpha, 1e-6), 1 - 1e-6), r.c, max_gamma, verify_cost=r.v)


def markdown(title: str, rows: list[Row]) -> str:
    lines = [f"**{title}**", "",
             "| drafter | γ | tok/s | speedup vs γ=0 | predicted E[tokens]/(γc+v) | measured / predicted | α | c | v | drafted/call | time in engines |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.gamma == 0:
            lines.append(f"| – (autoregressive) | 0 | {r.tokens_per_s:.0f} | 1.00 | – | – | – | – | – | – | {r.engine_share:.0%} |")
            continue
        pred = f"{r.predicted:.2f} | {r.speedup / r.predicted:.2f}" if r.predicted else "– | –"
        lines.append(f"| {r.drafter} | {r.gamma} | {r.tokens_per_s:.0f} | {r.speedup:.2f} | {pred} | "
                     f"{r.alpha:.3f} | {r.c:.3f} | {r.v:.2f} | {r.mean_proposed:.2f} | {r.engine_share:.0%} |")
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
        for drafter in dict.fromkeys(r.drafter for r in rows if r.gamma):
            spec = [r for r in rows if r.drafter == drafter and isinstance(r.gamma, int)]
            name = f"{title} {drafter}"
            if spec:
                line = a.plot([0] + [r.gamma for r in spec], [1.0] + [r.speedup for r in spec], marker="o", label=name)[0]
                pred = [r for r in spec if r.predicted]
                if pred:
                    a.plot([r.gamma for r in pred], [r.predicted for r in pred], ls="--", color=line.get_color(), label=f"{name} predicted")
                top = max(spec, key=lambda r: r.gamma)
                b.plot(range(1, len(top.per_position) + 1), top.per_position, marker="o", color=line.get_color(), label=f"{name} (γ={top.gamma})")
            for r in rows:
                if r.drafter == drafter and r.gamma == "auto":
                    a.axhline(r.speedup, ls=":", color=line.get_color() if spec else None, label=f"{name} adaptive γ")
    from matplotlib.ticker import MaxNLocator

    for ax in (a, b):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    a.axhline(1.0, color="grey", lw=0.8)
    a.set(xlabel="γ (draft tokens per target call)", ylabel="speedup over γ = 0", title="Walltime improvement")
    b.set(xlabel="draft position i", ylabel="P(drafts 1..i all accepted)", title="Acceptance by draft position", ylim=(0, 1.05))
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

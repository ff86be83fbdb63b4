"""The sweep's rows as markdown, JSON-ready dicts and a plot (matplotlib, ``pip install 'specdec[bench]'``)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from specdec.bench.sweep import Row


def markdown(title: str, rows: list[Row]) -> str:
    lines = [f"**{title}**", "",
             "| drafter | γ | tok/s | speedup vs γ=0 | predicted E[tokens]/(γc+v) | measured / predicted | α | c | v | drafted/call | tokens/call | kept by sibling rank | time in engines | × bandwidth floor |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        floor = f"{r.floor_ratio:.2f}" if r.floor_ratio else "–"
        if r.gamma == 0:
            lines.append(f"| – (autoregressive) | 0 | {r.tokens_per_s:.0f} | 1.00 | – | – | – | – | – | – | 1.00 | – | {r.engine_share:.0%} | {floor} |")
            continue
        pred = f"{r.predicted:.2f} | {r.speedup / r.predicted:.2f}" if r.predicted else "– | –"
        lines.append(f"| {r.drafter} | {r.gamma} | {r.tokens_per_s:.0f} | {r.speedup:.2f} | {pred} | "
                     f"{r.alpha:.3f} | {r.c:.3f} | {r.v:.2f} | {r.mean_proposed:.2f} | {r.tokens_per_call or 0:.2f} | "
                     f"{' '.join(f'{x:.3f}' for x in r.rank_acceptance[:4]) or '–'} | {r.engine_share:.0%} | {floor} |")
    return "\n".join(lines) + "\n"


def write_results(out: Path | None, md: str, rows) -> None:
    """``results.md`` and ``results.json`` (``rows``, JSON-ready) in ``out``; nothing when None."""
    if out is None:
        return
    import json

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(md)
    (out / "results.json").write_text(json.dumps(rows, indent=1))


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

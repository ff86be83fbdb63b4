"""The sweep's rows as markdown, JSON-ready dicts and a plot (matplotlib, ``pip install 'specdec[bench]'``)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from specdec.commands.bench.sweep import Row

REPO = Path(__file__).resolve().parents[2]  # the checkout, when specdec runs from one


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


def command_line(argv: list[str] | None = None) -> str:
    """The command that is running, as a user would type it again: ``specdec bench B ...`` for a
    console script, ``python tools/x.py ...`` (relative to the checkout) for a script."""
    import os
    import shlex
    import sys

    argv = list(sys.argv if argv is None else argv)
    head = Path(argv[0])
    if head.name in ("__main__.py", "-m"):  # python -m specdec (before the .py rule: it is a .py file too)
        return shlex.join(["python", "-m", "specdec", *argv[1:]])
    if head.suffix == ".py":
        try:
            shown = str(head.resolve().relative_to(REPO))
        except ValueError:
            shown = str(head)
        return shlex.join(["python", shown, *argv[1:]])
    return shlex.join([os.path.basename(argv[0]), *argv[1:]])


def provenance(argv: list[str] | None = None) -> dict:
    """What made a results file: the command line, the commit it ran at (``+dirty`` with
    uncommitted changes to tracked files; None outside a checkout), when, on what machine,
    with which library versions."""
    import datetime
    import os
    import platform
    import subprocess
    import sys
    from importlib.metadata import PackageNotFoundError, version

    def git(*args: str) -> str | None:
        if not (REPO / "pyproject.toml").is_file() or 'name = "specdec"' not in (REPO / "pyproject.toml").read_text():
            return None  # an installed specdec, not a checkout: no commit to name
        try:
            run = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return run.stdout.strip() if run.returncode == 0 else None

    commit = git("rev-parse", "--short=12", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    cpu = next((ln.split(":", 1)[1].strip() for ln in _read("/proc/cpuinfo").splitlines() if ln.startswith("model name")), platform.processor())
    mem = next((int(ln.split()[1]) / 2**20 for ln in _read("/proc/meminfo").splitlines() if ln.startswith("MemTotal:")), None)
    versions = {"python": platform.python_version()}
    for dist in ("specdec", "numpy", "onnxruntime", "onnxruntime-gpu", "torch", "transformers"):
        if dist.replace("-gpu", "") in sys.modules or dist in ("specdec", "numpy"):
            try:
                versions[dist] = version(dist)
            except PackageNotFoundError:
                pass
    return {
        "command": command_line(argv),
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem, 1) if mem else None, "os": platform.platform()},
        "versions": versions,
    }


def footer(prov: dict) -> str:
    """The line a results.md ends with: how to make it again."""
    at = f" at commit {prov['commit']}" if prov.get("commit") else ""
    return f"\n_Regenerate: `{prov['command']}`{at}; {prov['machine']['cpu']}, {prov['machine']['cores']} cores._\n"


def write_results(out: Path | None, md: str | None, data, plot=None, name: str = "results") -> dict | None:
    """``NAME.json`` (and ``NAME.md`` unless ``md`` is None) in ``out``, each naming the command
    that made them (the JSON's ``provenance``; a list of rows is stored under ``rows``);
    ``plot(path)`` draws ``bench.png`` when given and matplotlib is installed. Returns the
    provenance (None: no ``out``)."""
    if out is None:
        return None
    import json
    import sys

    prov = provenance()
    out.mkdir(parents=True, exist_ok=True)
    if md is not None:
        (out / f"{name}.md").write_text(md.rstrip("\n") + "\n" + footer(prov))
    body = {"provenance": prov, **(data if isinstance(data, dict) else {"rows": data})}
    (out / f"{name}.json").write_text(json.dumps(body, indent=1, default=str))
    if plot is not None:
        try:
            plot(out / "bench.png")
        except ImportError:
            print("plots need matplotlib: pip install 'specdec[bench]'", file=sys.stderr)
    return prov


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


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

"""Does every install line users are given resolve at once on a fresh machine? (a release step)

Each line (the README Quick start's two, and one per extra) is resolved in a clean venv made
here, with that venv's own pip and an empty pip cache, by ``pip install --dry-run
--ignore-installed --report``: what a new machine's first install does before it downloads
anything to keep. A line fails when it takes longer than ``--limit`` seconds or when pip looks
at more than ``--max-extra`` candidates beyond one version per project (backtracking: pip 23's
resolver once walked s3fs, gcsfs and adlfs back to 2023 on the test line, 35 minutes).

    python tools/check_install.py --out docs/bench/install

The test extra's exact pins are recorded in the results (``test_pins``), and tests/test_repo.py
fails when pyproject's pins and that record disagree: change a pin, run this again.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from specdec.commands.bench.report import write_results  # noqa: E402

EXTRAS = ("export", "gpu", "bench", "serve", "store", "gcs", "azure", "ray", "docs")
# a candidate pip looked at: a wheel or sdist it downloaded, found on disk or took from its cache
CANDIDATE = re.compile(r"^\s*(?:Downloading|Processing|Using cached)\s+(\S+?\.(?:whl|tar\.gz|zip))\b")


def quick_start_lines() -> list[str]:
    """The pip arguments of the README's two Quick-start commands (the part before ``&&``)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_repo import quick_start_commands

    return [cmd.split("&&", 1)[0].strip() for cmd in quick_start_commands()]


def lines_to_check() -> dict[str, list[str]]:
    """name -> pip install arguments; ``.`` is this checkout."""
    lines = {f"quick-start-{i + 1}": shlex.split(line)[2:] for i, line in enumerate(quick_start_lines())}
    for extra in EXTRAS:
        lines[f"[{extra}]"] = [f".[{extra}]"]
    return lines


def candidates(log: str) -> dict[str, set[str]]:
    """project -> the versions pip looked at, from its ``-v`` log."""
    seen: dict[str, set[str]] = {}
    for line in log.splitlines():
        m = CANDIDATE.match(line)
        if not m:
            continue
        name = Path(m.group(1)).name
        try:
            project, version = (parse_wheel_filename(name)[:2] if name.endswith(".whl") else parse_sdist_filename(name))
        except ValueError:
            continue
        seen.setdefault(canonicalize_name(project), set()).add(str(version))
    return seen


def resolve(args: list[str], limit: float, workdir: Path) -> dict:
    """One line resolved in a fresh venv with an empty cache: seconds, pip's version, the
    candidates beyond one per project, and what it would install."""
    venv, cache, report = workdir / "venv", workdir / "cache", workdir / "report.json"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    pip_version = subprocess.run([*pip, "--version"], capture_output=True, text=True).stdout.split()[1]
    args = [str(ROOT) + a[1:] if a.startswith(".") else a for a in args]
    cmd = [*pip, "install", "--dry-run", "--ignore-installed", "--report", str(report), "-v", "--cache-dir", str(cache), *args]
    start = time.perf_counter()
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=limit * 3)
        log, rc = run.stdout + run.stderr, run.returncode
    except subprocess.TimeoutExpired as e:
        log, rc = (e.stdout or b"").decode() + (e.stderr or b"").decode(), None
    seconds = time.perf_counter() - start
    seen = candidates(log)
    extra = {p: sorted(v) for p, v in seen.items() if len(v) > 1}
    installed = {}
    if rc == 0:
        installed = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
                     for i in json.loads(report.read_text())["install"]}
    return {"pip": pip_version, "returncode": rc, "seconds": round(seconds, 1), "projects": len(installed),
            "extra_candidates": sum(len(v) - 1 for v in extra.values()), "backtracked": extra,
            "installs": installed, "timed_out": rc is None,
            "log_tail": [ln for ln in log.splitlines() if not ln.startswith("WARNING: Location")][-5:] if rc != 0 else []}


def test_pins() -> dict[str, str]:
    """The test extra's exact pins: project -> version."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    return {canonicalize_name(d.split("==")[0]): d.split("==")[1] for d in deps if "==" in d}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=float, default=120.0, help="seconds a line may take to resolve")
    ap.add_argument("--max-extra", type=int, default=5, help="candidates beyond one version per project a line may look at")
    ap.add_argument("--only", action="append", help="check only these lines (names as printed), repeatable")
    ap.add_argument("--out", type=Path, help="write results.json / results.md here")
    a = ap.parse_args()

    results, failed = {}, []
    for name, args in lines_to_check().items():
        if a.only and name not in a.only:
            continue
        with tempfile.TemporaryDirectory(prefix="specdec-install-") as tmp:
            r = resolve(args, a.limit, Path(tmp))
        ok = r["returncode"] == 0 and r["seconds"] <= a.limit and r["extra_candidates"] <= a.max_extra
        r["ok"], r["args"] = ok, " ".join(args)
        results[name] = r
        print(f"{'ok  ' if ok else 'FAIL'} {name:14s} {r['seconds']:7.1f} s  {r['projects']:4d} projects  "
              f"{r['extra_candidates']:3d} extra candidates  (pip {r['pip']})"
              + (f"  backtracked: {', '.join(r['backtracked'])}" if r["backtracked"] else ""), flush=True)
        if not ok:
            failed.append(name)
            for ln in r["log_tail"]:
                print("     ", ln)
    md = ["| line | pip arguments | seconds | projects | extra candidates | ok |", "|---|---|---:|---:|---:|---|"]
    md += [f"| {n} | `{r['args']}` | {r['seconds']:.1f} | {r['projects']} | {r['extra_candidates']} | {'yes' if r['ok'] else '**no**'} |"
           for n, r in results.items()]
    write_results(a.out, "\n".join(md) + "\n",
                  {"limit_s": a.limit, "max_extra": a.max_extra, "test_pins": test_pins(), "lines": results})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The README's Quick start and .ci/run must agree: CI runs what users are told to run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [ln.strip() for ln in block.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def test_quick_start_has_two_commands():
    cmds = quick_start_commands()
    assert len(cmds) == 2, cmds
    assert "specdec" in cmds[0]
    assert "pytest" in cmds[1]


def test_ci_runs_the_quick_start_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    body = [ln.strip() for ln in ci if ln.strip() and not ln.strip().startswith("#")]
    assert quick_start_commands()[1] in body


def test_every_upper_pin_says_why():
    """An upper bound on a dependency breaks users' stacks; each one carries its reason on its line."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = (ROOT / "pyproject.toml").read_text().splitlines()
    pinned = [d for d in project["dependencies"] + sum(project["optional-dependencies"].values(), []) if "<" in d]
    for dep in pinned:
        line = next(ln for ln in lines if f'"{dep}"' in ln)
        assert "#" in line.split(f'"{dep}"', 1)[1], f"{dep}: an upper pin without a reason beside it"
    users = project["dependencies"] + project["optional-dependencies"]["export"]  # what users install to export: never a downgrade
    assert not any(d.startswith(("transformers", "optimum")) and "<" in d for d in users)


def test_every_subpackage_is_packaged():
    """pyproject's package list is explicit (the code folders are subpackages of ``specdec``): a
    folder with an ``__init__.py`` left out of it is missing from every wheel and non-editable install."""
    import tomllib

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, dirs = set(tool["packages"]), tool["package-dir"]
    found = set()
    for name, folder in dirs.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            if "__pycache__" not in rel.parts:
                found.add(".".join([name, *rel.parts]))
    assert found and found <= listed, f"not in [tool.setuptools] packages: {sorted(found - listed)}"


def test_install_lines_were_checked_with_these_pins():
    """tools/check_install.py resolved every Quick-start line and every extra in a clean venv, at
    once, with the test extra's pins as they are now (a pin changed, or an extra added, without
    running it again fails here)."""
    import json
    import tomllib

    record = json.loads((ROOT / "docs" / "bench" / "install" / "results.json").read_text())
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = {d.split("==")[0]: d.split("==")[1] for d in extras["test"] if "==" in d}
    assert pins == record["test_pins"], "the test extra's pins changed: run python tools/check_install.py --out docs/bench/install"
    for family in ("fsspec", "s3fs", "gcsfs", "adlfs", "aiobotocore", "botocore", "boto3"):
        assert family in pins, f"{family}: unpinned in the test extra (pip backtracks through it for half an hour)"
    lines = record["lines"]
    assert {f"[{e}]" for e in extras if e != "test"} <= set(lines), "an extra that tools/check_install.py never resolved"
    import shlex

    given = [" ".join(shlex.split(c.split("&&")[0])[2:]) for c in quick_start_commands()]  # after `pip install`
    assert [lines[f"quick-start-{i + 1}"]["args"] for i in range(2)] == given, "the Quick start changed: run tools/check_install.py again"
    for name, line in lines.items():
        assert line["ok"] and line["seconds"] <= record["limit_s"] and line["extra_candidates"] <= record["max_extra"], name


def test_backtracking_is_seen_in_pips_log():
    """The check's detector counts the versions of one project pip looked at, whichever way it got them."""
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    from check_install import candidates

    log = """Processing /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
Collecting s3fs>=2023.6 (from specdec==0.1.0)
  Downloading s3fs-2026.9.0-py3-none-any.whl (33 kB)
INFO: pip is looking at multiple versions of s3fs to determine which version is compatible
  Downloading s3fs-2026.7.0-py3-none-any.whl (32 kB)
  Using cached s3fs-2026.6.0-py3-none-any.whl (32 kB)
  Downloading Aio_Botocore-2.5.4.tar.gz (100 kB)
  Link requires a different Python (3.11.7 not in: '>=3.12'): https://x/networkx-3.7-py3-none-any.whl
"""
    seen = candidates(log)
    assert seen == {"torch": {"2.13.0+cpu"}, "s3fs": {"2026.9.0", "2026.7.0", "2026.6.0"}, "aio-botocore": {"2.5.4"}}

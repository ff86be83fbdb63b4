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

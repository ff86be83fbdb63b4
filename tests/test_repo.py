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

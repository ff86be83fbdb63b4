"""Every results file under docs/bench names the command that regenerates it, and that command runs.

A results JSON is an object whose ``provenance`` holds the ``command`` and the ``commit`` it ran
at (``specdec.commands.bench.report.write_results`` stamps it; older files were stamped by hand). A
results Markdown file ends with a ``Regenerate:`` line naming the same. The command is either
live (``specdec ...`` or ``python tools/...``: the program exists in this tree and accepts every
option the command gives) or ``archived``: the question it answered is settled, its script was
removed, and it runs in a worktree of the commit named (checked where the history is there).
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "bench"
PROSE = {"notes.md", "README.md"}  # explanations next to results, not results
REGENERATE = re.compile(r"Regenerate: `([^`]+)`(?: at commit ([0-9a-f]{7,40}))?")


def results_files() -> list[Path]:
    return sorted(p for p in BENCH.rglob("*") if p.suffix in (".json", ".md") and p.name not in PROSE)


def provenance_of(path: Path) -> dict:
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        assert isinstance(data, dict) and isinstance(data.get("provenance"), dict), f"{path}: no provenance object"
        return data["provenance"]
    found = REGENERATE.findall(path.read_text())
    assert found, f"{path}: no 'Regenerate: `COMMAND`' line"
    command, commit = found[-1]
    return {"command": command, "commit": commit or None, "archived": "archived" in path.read_text().rsplit("Regenerate:", 1)[1]}


def options(command: str) -> tuple[list[str], list[str]]:
    """(program words, long options) of a command line: ``specdec bench``, ``python tools/x.py``."""
    words = shlex.split(command)
    if words[0] == "python":
        words = words[1:]
    program = words[:2] if words[0] in ("specdec", "specdec-export") or words[:2] == ["-m", "specdec"] else words[:1]
    if program == words[:1] and len(words) > 1 and re.fullmatch(r"[a-z][a-z-]*", words[1]) and words[1] in subcommands(words[0]):
        program = words[:2]  # a script with subcommands: `python tools/train/smollm2_draft.py train ...`
    return program, [w.split("=", 1)[0] for w in words if w.startswith("--")]


def subcommands(script: str) -> set[str]:
    """The subcommands a tools/ script's --help lists as ``{a,b,c}`` (none for a script without)."""
    if not (ROOT / script).is_file():
        return set()
    found = re.search(r"\{([a-z,-]+)\}", help_text((script,)))
    return set(found.group(1).split(",")) if found else set()


@functools.cache
def help_text(program: tuple[str, ...]) -> str:
    if program[0] in ("specdec", "-m"):
        from click.testing import CliRunner

        from specdec.commands.cli.main import cli

        sub = program[-1] if program[0] == "specdec" else program[2]
        res = CliRunner().invoke(cli, [sub, "--help"])
        assert res.exit_code == 0, f"specdec {sub} --help: {res.output}"
        return res.output
    if program[0] == "specdec-export":
        from click.testing import CliRunner

        from specdec.commands.cli.bundle import export_cmd

        return CliRunner().invoke(export_cmd, ["--help"]).output
    script = ROOT / program[0]
    assert script.is_file(), f"{program[0]} does not exist in this tree"
    res = subprocess.run([sys.executable, str(script), *program[1:], "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, f"{program[0]} --help failed: {res.stderr[-500:]}"
    return res.stdout


def in_history(commit: str, path: str) -> bool | None:
    """Whether ``path`` exists at ``commit`` (None: this checkout lacks that history)."""
    if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True).returncode != 0:
        return None
    return subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}:{path}"], capture_output=True).returncode == 0


@pytest.mark.parametrize("path", results_files(), ids=lambda p: str(p.relative_to(BENCH)))
def test_results_file_names_a_command_that_runs(path):
    prov = provenance_of(path)
    command, commit = prov.get("command"), prov.get("commit")
    assert isinstance(command, str) and command.strip(), f"{path}: provenance without a command"
    assert commit is None or re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?", commit), f"{path}: commit {commit!r}"
    program, opts = options(command)
    if prov.get("archived"):
        assert commit, f"{path}: an archived command must name the commit to run it at"
        assert program[0].startswith("tools/"), f"{path}: only tools/ scripts are archived, not {program}"
        assert in_history(commit.split("+")[0], program[0]) is not False, f"{path}: {program[0]} is not in commit {commit}"
        return
    text = help_text(tuple(program))
    missing = [o for o in opts if o not in text]
    assert not missing, f"{path}: `{command}` gives {missing}, which {' '.join(program)} does not take"

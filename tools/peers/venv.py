"""Private virtual environments for the peers that need libraries of their own (onnxruntime-genai,
OpenVINO GenAI, llama-cpp-python), created on first use under ``.bench/<name>/``, and the
once-only builds (model conversions) made with them.

A venv counts as ready when its python exists and its stamp file lists exactly the packages
(and build environment) of its ``VenvSpec``; anything else is (re)installed with pip, which
leaves already satisfied pins alone. pip's output goes to ``.bench/<name>.install.log``; progress
lines go to stderr.
"""

from __future__ import annotations

import os
import subprocess
import sys
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from peers.base import REPO, ModeUnavailable, log

BENCH = REPO / ".bench"  # git-ignored
STAMP = ".specdec-peer-ok"


class SetupError(RuntimeError):
    """A private venv or a model conversion could not be made; the message says which step and
    where its log is."""


@dataclass(frozen=True)
class VenvSpec:
    """One private venv: its folder name under ``.bench/``, the pinned requirements, a python
    statement that must run once they are installed, and extra environment for pip (a source
    build's ``CMAKE_ARGS``)."""

    name: str
    packages: tuple[str, ...]
    probe: str
    build_env: dict[str, str] = field(default_factory=dict)
    remove: tuple[str, ...] = ()  # pulled in as dependencies but broken here: uninstalled afterwards
    note: str = ""  # what the install costs, for the log
    root: Path = BENCH  # the venv is root/name

    def __post_init__(self) -> None:
        if not self.packages:
            raise ValueError(f"venv {self.name}: no packages to install")

    @property
    def folder(self) -> Path:
        return self.root / self.name

    @property
    def python(self) -> Path:
        return self.folder / "bin" / "python"

    def stamp_text(self) -> str:
        env = [f"{k}={v}" for k, v in sorted(self.build_env.items())]
        return "\n".join([*self.packages, *env, *(f"-{r}" for r in self.remove)]) + "\n"

    def ready(self) -> bool:
        stamp = self.folder / STAMP
        return self.python.exists() and stamp.is_file() and stamp.read_text() == self.stamp_text()


def run_logged(cmd: list[str], log_file: Path, what: str, env: dict[str, str] | None = None,
               timeout_s: float = 3600) -> None:
    """Run ``cmd`` at the lowest CPU priority with its output appended to ``log_file``; raise
    SetupError naming ``what`` and the log's last lines when it fails or outlives ``timeout_s``."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        try:
            proc = subprocess.run(["nice", "-n", "19", *cmd], stdout=out, stderr=subprocess.STDOUT,
                                  env=dict(os.environ, **(env or {})), timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise SetupError(f"{what} took over {timeout_s:.0f} s; stopped (log {log_file})") from exc
    if proc.returncode != 0:
        tail = " / ".join(log_file.read_text(errors="replace").strip().splitlines()[-3:])
        raise SetupError(f"{what} failed (rc={proc.returncode}; log {log_file}): {tail[-400:]}")


def ensure_venv(spec: VenvSpec, setup: bool = True) -> Path:
    """The python of ``spec``'s venv, installing it first when missing or stale.

    Raises ModeUnavailable when it is missing and ``setup`` is off, SetupError when creating it
    fails (the peer is then listed as unavailable with that reason).
    """
    if spec.ready():
        return spec.python
    if not setup:
        raise ModeUnavailable(f"no ready venv at {spec.folder} (--no-setup given; run without it to create it)")
    log_file = spec.root / f"{spec.name}.install.log"
    t0 = time.perf_counter()
    if not spec.python.exists():
        log(f"{spec.name}: creating venv {spec.folder}")
        run_logged([sys.executable, "-m", "venv", str(spec.folder)], log_file, f"creating venv {spec.folder}")
    log(f"{spec.name}: pip install {' '.join(spec.packages)}{' (' + spec.note + ')' if spec.note else ''}; log {log_file}")
    run_logged([str(spec.python), "-m", "pip", "install", "--disable-pip-version-check", *spec.packages],
               log_file, f"pip install into {spec.folder}", env=spec.build_env)
    if spec.remove:
        log(f"{spec.name}: pip uninstall {' '.join(spec.remove)}")
        run_logged([str(spec.python), "-m", "pip", "uninstall", "-y", *spec.remove], log_file, f"pip uninstall in {spec.folder}")
    run_logged([str(spec.python), "-c", spec.probe], log_file, f"import check in {spec.folder}")
    (spec.folder / STAMP).write_text(spec.stamp_text())
    log(f"{spec.name}: ready in {time.perf_counter() - t0:.0f}s")
    return spec.python


def build_once(out: Path, build: Callable[[Path], None], what: str, setup: bool = True) -> Path:
    """``out``, made by ``build(tmp)`` into a sibling temporary folder and renamed into place on
    success (so a folder that exists is complete); reused as is when it exists.

    Raises ModeUnavailable when it is missing and ``setup`` is off.
    """
    if out.is_dir():
        return out
    if not setup:
        raise ModeUnavailable(f"no {what} at {out} (--no-setup given; run without it to convert)")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    log(f"building {what} -> {out}")
    build(tmp)
    tmp.rename(out)
    log(f"built {what} in {time.perf_counter() - t0:.0f}s")
    return out

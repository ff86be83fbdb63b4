"""The benchmark's prompts: CPython stdlib files, split into training and held-out files as the
demo pair was trained (the split rule lives only here)."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

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

"""Files and folders written whole or not at all: a hidden temporary beside the target, then a rename.

The one helper for it (distill shards and plan, prompts, the features cache, the verification
stamps, a merged corpus, the peers' converted models): an interrupted write leaves nothing under
the target's name, and a failed one removes its temporary.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import IO, Callable


def partial_name(path: Path, unique: bool = False) -> Path:
    """``.<name>.partial`` beside ``path`` (never a name a reader looks for); ``unique``: also this
    process's and thread's ids, for a target that concurrent writers replace."""
    tag = f".{os.getpid()}.{threading.get_ident()}" if unique else ""
    return path.with_name(f".{path.name}{tag}.partial")


def write_atomic(path: Path, write: Callable[[IO[bytes]], None], unique: bool = False) -> Path:
    """Call ``write(fh)`` on a hidden temporary beside ``path`` (``partial_name``), then rename it
    to ``path``: an interrupted write leaves no file under that name. ``unique``: concurrent
    writers each write their own temporary, and the last rename wins."""
    path = Path(path)
    tmp = partial_name(path, unique)
    try:
        with open(tmp, "wb") as fh:
            write(fh)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def build_atomic(path: Path, build: Callable[[Path], object]):
    """Call ``build(tmp)`` on an empty hidden folder beside ``path``, then rename it to ``path``
    (which must not exist); on failure the folder is removed. Returns what ``build`` returned."""
    path = Path(path)
    tmp = partial_name(path)
    shutil.rmtree(tmp, ignore_errors=True)  # what an interrupted run left
    tmp.mkdir(parents=True)
    try:
        out = build(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tmp.rename(path)
    return out

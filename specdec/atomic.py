"""Files written whole or not at all: a hidden temporary beside the target, then a rename."""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Callable


def write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> Path:
    """Call ``write(fh)`` on ``.<name>.partial`` beside ``path`` (never a name a reader looks for),
    then rename it to ``path``: an interrupted write leaves no file under that name."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    with open(tmp, "wb") as fh:
        write(fh)
    os.replace(tmp, path)
    return path

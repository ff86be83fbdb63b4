"""The transformers versions export is tested on, and a one-line refusal of the ones it cannot run.

Export reaches into transformers' internals (the attention interface, the cache classes, the
GGUF loader), which change between majors. The suite runs on the newest 5.x the pins allow and,
in a second venv, on 4.57 (tools/test_stacks.sh). Older than 4.57 lacks what export uses
(``AttentionInterface`` as it registers, ``dtype=``): refused before anything loads. Newer than
the newest tested is let through; a failure inside it is reported by the pipeline in one line
naming the version and this range.
"""

from __future__ import annotations

import importlib.metadata as md

from specdec.errors import ModelError

OLDEST = (4, 57)  # the oldest minor tested
NEWEST = (5, 24)  # the newest minor tested


def _minor(version: str) -> tuple[int, int]:
    parts = (version.split(".") + ["0"])[:2]
    return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts)  # type: ignore[return-value]


def installed() -> tuple[int, int]:
    """The installed transformers' (major, minor)."""
    return _minor(md.version("transformers"))


def tested_range() -> str:
    return f"transformers {OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]}"


def check_transformers() -> str:
    """The installed transformers version, or a ModelError when it is older than export supports."""
    try:
        version = md.version("transformers")
    except md.PackageNotFoundError:
        raise ModelError('export needs transformers; pip install -e ".[export]"') from None
    if _minor(version) < OLDEST:
        raise ModelError(f"transformers {version} is older than export supports ({tested_range()} tested); "
                         'pip install -U "transformers>=4.57"')  # fmt: skip
    return version

"""One finding of ``specdec check``: a section, a name, a verdict, what was seen, and the fix."""

from __future__ import annotations

from typing import NamedTuple


class Item(NamedTuple):
    section: str  # "integrity", "exactness" or "speed"
    name: str
    ok: bool | None  # True passed, False failed (the exit status is then 1), None: information
    detail: str  # what was measured or seen, one line
    fix: str = ""  # for a failure: what to do

    def as_dict(self) -> dict:
        return self._asdict()

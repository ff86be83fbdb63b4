"""Side-by-side timing's one order of runs (the foundation: export's measurement, ``specdec
bench``, ``specdec check`` and tools/ walk their runs so).

    interleaved(items, rounds) -> (round, item) ...
"""

from __future__ import annotations


def interleaved(items: list, rounds: int):
    """(round, item) for ``rounds`` rounds over ``items``, the order reversed every other round:
    drift on a shared machine (heat, other load) falls on every item alike, and no item always
    runs first."""
    for r in range(rounds):
        for item in items if r % 2 == 0 else items[::-1]:
            yield r, item

"""γ, decided in one place: what a request asks, the bundle's measured recommendation and its
verify graph's width give each request its γ (and whether it adapts); every bad value is one
``ConfigError`` naming it.

    resolve(asked, ceiling, recommended) -> (γ, adaptive)
        asked: an int 0..the bundle's γ, "auto" (chosen each step by ``runtime.adaptive`` from
        the measured acceptance and costs, up to the bundle's γ), or None: the γ the bundle's
        default drafter was measured best at (``manifest.drafter``, recorded by export), when
        the engine runs that drafter, else the bundle's γ
    check(asked, ceiling, auto=True) -> int | "auto"
        the same check for a value given before a bundle is at hand (a CLI option, a server's
        --gamma, a beam search's draft steps)
"""

from __future__ import annotations

import numpy as np

from specdec.errors import ConfigError

AUTO = "auto"


def is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def check(asked, ceiling: int | None, auto: bool = True, what: str = "gamma"):
    """``asked`` if it is a γ this bundle's verify graph takes (0..``ceiling``; None: any >= 0)
    or, with ``auto``, "auto"; a ``ConfigError`` naming it otherwise."""
    if auto and asked == AUTO:
        return AUTO
    if not is_int(asked) or asked < 0 or (ceiling is not None and asked > ceiling):
        either = " or 'auto'" if auto else ""
        label = f"{what} {asked!r}" if what.startswith("--") else f"{what}={asked!r}"  # an option as click shows it, a field as Python does
        if ceiling is None:
            raise ConfigError(f"{label}: expected an integer >= 0{either}")
        raise ConfigError(f"{label}: this bundle's verify graph takes K={ceiling + 1} tokens, so {what} must be "
                          f"0..{ceiling}{either}; re-export with a larger --gamma for more")  # fmt: skip
    return int(asked)


def resolve(asked, ceiling: int, recommended: int | None = None) -> tuple[int, bool]:
    """(γ, adaptive) of a request asking ``asked`` of a bundle whose verify graph takes
    ``ceiling`` drafts (``Limits.max_gamma``), ``recommended`` the γ its default drafter was
    measured best at when the engine runs that drafter (``Limits.default_gamma``). An adaptive
    request's γ is its ceiling."""
    if asked is None:
        return (ceiling if recommended is None else recommended), False
    g = check(asked, ceiling)
    return (ceiling, True) if g == AUTO else (g, False)

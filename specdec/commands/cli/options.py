"""What several commands share: the BUNDLE argument, option values parsed into the library's
terms, and the step bar of long work.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from specdec.errors import InputError


class BundleArg(click.ParamType):
    """A bundle folder, or a stored bundle's URI (s3://, https://, ...; ``specdec push``), fetched
    once into this machine's verified cache (specdec/store.py)."""

    name = "bundle"

    def convert(self, value, param, ctx) -> Path:
        from specdec.store import local

        return local(value)


BUNDLE = BundleArg()
PROVIDERS = ["cpu", "cuda", "cuda-graph"]
PROVIDER_OPTION = click.option("--provider", default="cpu", show_default=True, type=click.Choice(PROVIDERS), help="ONNX Runtime provider (docs/gpu.md).")
DRAFT_PROVIDER_OPTION = click.option("--draft-provider", default=None, type=click.Choice(PROVIDERS),
                                     help="Where the draft model or the feature head runs, e.g. cpu beside a target on cuda-graph [default: --provider].")


def text_or_ids(option: str, text: str | None, ids: str | None) -> str | list[int] | None:
    """The value of ``option`` TEXT or its ``-ids`` twin (comma-separated ids); at most one may be given."""
    if text is not None and ids is not None:
        raise InputError(f"give exactly one of {option} TEXT and {option}-ids 1,2,3, not both")
    if ids is None:
        return text
    try:
        return [int(x) for x in ids.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"{option}-ids {ids!r}: expected comma-separated integers such as 1,2,3") from None


def thread_policy(threads: int | None):
    """--threads: the library's default policy (a pool per session; see engines.threads)."""
    from specdec.engines.threads import ThreadPolicy

    if threads is not None and threads < 1:
        raise InputError(f"--threads {threads}: expected an integer >= 1")
    return ThreadPolicy.per_session(threads)


def parse_gamma(text: str | None, auto: bool = True) -> int | str | None:
    """--gamma: an integer, "auto" (with ``auto``), or unset; the bundle's ceiling is checked
    with the request (``runtime.gamma``, one ``ConfigError`` for every bad value)."""
    from specdec.runtime.gamma import check

    if text is None:
        return None
    return check(int(text) if text.lstrip("-").isdigit() else text, None, auto, what="--gamma")


def parse_numbers(option: str, text: str, kind: type) -> list:
    """A comma-separated list of ``kind``, e.g. --gammas 0,1,2."""
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"{option} {text!r}: expected comma-separated numbers such as 0,1,2") from None


def with_progress(desc: str, work, total: int | None = None, phases=None):
    """Run ``work(report)`` with ``report(step)`` drawing a step bar on stderr. disable=None: no
    bar when stderr is not a terminal (CI, pipes), so errors stay one line. ``phases``: a stream
    that gets a line per finished step with its seconds."""
    import time

    from tqdm import tqdm

    current: list = []  # [step, start]

    def finish() -> None:
        if current and phases is not None:
            tqdm.write(f"  {current[0]:<34}{time.perf_counter() - current[1]:7.1f} s", file=phases)

    with tqdm(total=total, desc=desc, unit="step", file=sys.stderr, leave=False, disable=None) as bar:

        def report(step: str) -> None:
            finish()
            current[:] = [step, time.perf_counter()]
            bar.set_postfix_str(step)
            bar.update(1)

        out = work(report)
    finish()
    return out

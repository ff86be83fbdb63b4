"""What ``specdec check``'s sections share: one finding (``Item``), and the models loaded once (``Loaded``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple


class Item(NamedTuple):
    section: str  # "integrity", "exactness" or "speed"
    name: str
    ok: bool | None  # True passed, False failed (the exit status is then 1), None: information
    detail: str  # what was measured or seen, one line
    fix: str = ""  # for a failure: what to do

    def as_dict(self) -> dict:
        return self._asdict()


class Loaded(NamedTuple):
    """The bundle loaded once for every section: a decoder per drafter (forks of the first, over
    the same sessions) and the target's dynamic graph (None for an encoder-decoder)."""

    decoders: dict[str, Any]  # drafter name -> SpeculativeDecoder; the first is the bundle's default
    runner: Any  # specdec.commands.bench.quality.TargetRunner, or None

    @classmethod
    def of(cls, bundle: Path, m, drafters: list[str], threads, provider: str = "cpu") -> Loaded:
        from specdec.commands.bench.quality import TargetRunner
        from specdec.runtime.decoder import SpeculativeDecoder

        base = SpeculativeDecoder.load(bundle, threads=threads, drafter=drafters[0], verify="size", provider=provider)  # digests: the integrity section
        runner = None if m.seq2seq else TargetRunner(bundle, threads, provider=provider)
        return cls({drafters[0]: base, **{d: base.fork(drafter=d) for d in drafters[1:]}}, runner)

    @property
    def base(self):
        return next(iter(self.decoders.values()))

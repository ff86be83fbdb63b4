"""What every peer shares: the options it starts from, the Peer interface, a request's and a run's sums."""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar


def log(msg: str) -> None:
    print(f"[bench-peers] {msg}", file=sys.stderr, flush=True)  # stdout is the table


def checkpoint_key(*dirs: Path) -> str:
    """12 hex digits naming a cache folder after checkpoint folders: their paths and their config and
    weight files' names, sizes and mtimes (an edited checkpoint gets a fresh build)."""
    h = hashlib.sha256()
    for d in dirs:
        h.update(str(d.resolve()).encode())
        for f in sorted(d.glob("*.json")) + sorted(d.glob("*.safetensors")):
            h.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    return h.hexdigest()[:12]


class ModeUnavailable(Exception):
    """A peer cannot run a mode; the message says why (it goes into the table)."""


@dataclass(frozen=True)
class Options:
    target: Path
    draft: Path | None  # a draft checkpoint for the draft-model modes, if given
    bundle: Path | None
    work: Path  # private venvs and converted models
    threads: int
    draft_tokens: int | None
    ngram_size: int
    n_ctx: int  # prompt + new tokens + room for the last round's proposals (llama.cpp)
    setup: bool


@dataclass
class Sample:
    """One timed request: decoding seconds, the tokens decoded in them, all new tokens, statistics."""

    seconds: float
    tokens: int
    new_tokens: int
    stats: dict[str, float] = field(default_factory=dict)
    ids: list[int] = field(default_factory=list)


@dataclass
class Tally:
    """Sums over every request of one (peer, mode, T); round 0's outputs per prompt."""

    seconds: float = 0.0
    tokens: int = 0
    new_tokens: int = 0
    requests: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    outputs: dict[int, list[int]] = field(default_factory=dict)

    def add(self, s: Sample) -> None:
        self.seconds, self.tokens = self.seconds + s.seconds, self.tokens + s.tokens
        self.new_tokens, self.requests = self.new_tokens + s.new_tokens, self.requests + 1
        for k, v in s.stats.items():
            self.stats[k] = self.stats.get(k, 0.0) + v


class Peer:
    """One decoding stack, started by ``Peer(options)`` (or it raises: the peer is then listed as
    unavailable, with why); ``settings`` go into the results."""

    name: ClassVar[str]
    modes: ClassVar[tuple[str, ...]]
    draft_modes: ClassVar[tuple[str, ...]] = ()  # the modes that need a draft checkpoint (--draft)
    settings: dict

    @classmethod
    def baseline(cls, mode: str) -> str | None:
        """What ``mode``'s speedup is over: the autoregressive mode of the same weights (``-q8_0``...); None for those."""
        if mode.startswith("autoregressive"):
            return None
        return next((a for a in cls.modes if a.startswith("autoregressive-") and mode.endswith(a.removeprefix("autoregressive"))), "autoregressive")

    def decode(self, mode: str, temperature: float, prompt: list[int], tokens: int, seed: int) -> Sample:
        """One request of exactly ``tokens`` new tokens (EOS ignored), seeded by ``seed``."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the peer holds (a worker process)."""

"""What every peer shares: where outputs go, progress logging, cache keys, the Peer interface
and the types a request and a run of requests produce."""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / ".bench" / "peers"


def log(msg: str) -> None:
    """Progress to stderr (stdout is the table)."""
    print(f"[bench_peers] {msg}", file=sys.stderr, flush=True)


def checkpoint_key(*dirs: Path) -> str:
    """12 hex digits naming a cache folder after checkpoint folders: their paths and the name,
    size and mtime of their config and weight files (an edited checkpoint gets a fresh build)."""
    h = hashlib.sha256()
    for d in dirs:
        h.update(str(d.resolve()).encode())
        for f in sorted(d.glob("*.json")) + sorted(d.glob("*.safetensors")):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


class ModeUnavailable(Exception):
    """A peer cannot run a mode; the message says why (it goes into the table)."""


@dataclass
class Sample:
    """One timed request: decoding seconds, tokens decoded in them, peer statistics."""

    seconds: float
    tokens: int
    new_tokens: int
    stats: dict[str, float] = field(default_factory=dict)
    ids: list[int] = field(default_factory=list)  # the new tokens themselves


@dataclass
class Tally:
    """Sums over every request of one (peer, mode, T)."""

    seconds: float = 0.0
    tokens: int = 0
    new_tokens: int = 0
    requests: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    outputs: dict[int, list[int]] = field(default_factory=dict)  # round 0's new tokens per prompt

    def add(self, s: Sample) -> None:
        self.seconds += s.seconds
        self.tokens += s.tokens
        self.new_tokens += s.new_tokens
        self.requests += 1
        for k, v in s.stats.items():
            self.stats[k] = self.stats.get(k, 0.0) + v


class Peer:
    """One decoding stack under test. ``from_args`` starts it from the driver's options (or
    raises: the peer is then listed as unavailable, with why); ``settings`` go into the results."""

    name: ClassVar[str]
    modes: ClassVar[tuple[str, ...]]
    settings: dict

    @classmethod
    def from_args(cls, args) -> Peer:
        raise NotImplementedError

    @staticmethod
    def baseline(mode: str) -> str | None:
        """The mode whose speed ``mode``'s speedup is measured against (None: it is a baseline)."""
        return None if mode == "autoregressive" else "autoregressive"

    def decode(self, mode: str, temperature: float, prompt: list[int], tokens: int, seed: int) -> Sample:
        """One request of exactly ``tokens`` new tokens (EOS ignored), seeded by ``seed``."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the peer holds (a worker process); most hold nothing."""

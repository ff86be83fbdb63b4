"""The peers ``tools/bench_peers.py`` measures, one module each, and what they share.

Importing this is cheap: each peer imports its heavy libraries (torch, optimum, specdec,
onnxruntime) only when it starts.
"""

from __future__ import annotations

from peers.base import OUT, ModeUnavailable, Peer, Sample, Tally, log
from peers.genai import GenaiPeer
from peers.hf import HFPeer
from peers.optimum import OptimumPeer
from peers.specdec import SpecdecPeer

# In start order (specdec last: it used to set a process-wide ORT pool; it no longer does).
PEER_CLASSES: dict[str, type[Peer]] = {p.name: p for p in (HFPeer, OptimumPeer, GenaiPeer, SpecdecPeer)}
PEERS = tuple(PEER_CLASSES)

__all__ = ["OUT", "PEERS", "PEER_CLASSES", "ModeUnavailable", "Peer", "Sample", "Tally", "log"]

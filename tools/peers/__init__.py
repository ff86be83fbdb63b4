"""The peers ``tools/bench_peers.py`` measures, one module each, and what they share.

Importing this is cheap: each peer imports its heavy libraries (torch, optimum, specdec,
onnxruntime) only when it starts, and the peers with private venvs (genai, openvino, llamacpp)
run their libraries in worker processes of those venvs.
"""

from __future__ import annotations

from peers.base import OUT, ModeUnavailable, Peer, Sample, Tally, log
from peers.genai import GenaiPeer
from peers.hf import HFPeer
from peers.llamacpp import LlamaCppPeer
from peers.openvino import OpenVINOPeer
from peers.optimum import OptimumPeer
from peers.specdec import SpecdecPeer

# In start order (specdec last: it used to set a process-wide ORT pool; it no longer does).
PEER_CLASSES: dict[str, type[Peer]] = {p.name: p for p in (HFPeer, OptimumPeer, GenaiPeer, OpenVINOPeer, LlamaCppPeer,
                                                           SpecdecPeer)}
PEERS = tuple(PEER_CLASSES)

__all__ = ["OUT", "PEERS", "PEER_CLASSES", "ModeUnavailable", "Peer", "Sample", "Tally", "log"]

"""The memory-bandwidth floor: how fast decoding could be if every call only read its bytes.

At batch 1 a decoder call reads every weight matrix once (and the KV rows it attends to) and
does little arithmetic per byte, so its time is bounded below by bytes / bandwidth. Here:

- ``read_bandwidth``: the rate at which this machine streams a float32 matrix of a given size
  through a matrix-vector product (NumPy's BLAS sgemv on every core, best of several runs):
  the fastest any batch-1 decoder reads its weights. It is measured at the size of the
  target's weights, read over and over as decoding does (on a CPU whose last-level cache
  holds part of them this beats DRAM), and at 512 MiB (DRAM) for reference. A plain NumPy
  reduction is compute-bound near 30 GB/s here and would understate it.
- ``call_bytes``: what one call of a model reads: its weights as the bundle stores them (the
  shared ``<model>.weights`` file: float32, float16, or MatMulNBits blocks and scales) less
  the embedding table (a Gather reads one row per token), plus the KV rows of ``context``
  positions. A bundle from before weights were shared counts one dynamic graph's data files.
- ``Floor``: both models' call floors; ``seconds(target_calls, draft_calls)`` is the floor of a
  decode, so a row's measured time / floor says how far it is from the bandwidth limit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ITEM = {"float32": 4, "float16": 2}


def read_bandwidth(nbytes: int, repeats: int = 7) -> float:
    """Bytes per second a float32 [rows, 1024] matrix of about ``nbytes`` is read at by sgemv."""
    rows = max(nbytes // 4096, 1)
    matrix = np.ones((rows, 1024), dtype=np.float32)  # [rows, 1024]
    vector = np.ones(rows, dtype=np.float32)  # [rows]
    vector @ matrix  # fault every page in before timing
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        vector @ matrix
        best = min(best, time.perf_counter() - t)
    return matrix.nbytes / best


def weights_bytes(bundle: Path, manifest, model: str) -> int:
    """``model``'s weights as stored: the external data its dynamic-length graph reads (the
    shared ``<model>.weights``; for an older bundle, that graph's own data files)."""
    _, g = manifest.graph(model, "dynamic")
    return sum((Path(bundle) / f).stat().st_size for f in g.data)


def call_bytes(bundle: Path, manifest, model: str, context: int) -> int:
    """Bytes one batch-1 call of ``model`` reads with ``context`` positions in its KV cache."""
    spec = getattr(manifest, model)
    weights = weights_bytes(bundle, manifest, model)
    item = ITEM[manifest.dtype]
    embedding = manifest.vocab_size * spec.hidden_size * item  # read a row per token, not in full
    kv = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * item * context
    return max(weights - embedding, 0) + kv


@dataclass(frozen=True)
class Floor:
    """Bandwidth and the per-call floors (seconds) of each model at the bench's mean context."""

    bandwidth: float  # bytes / s at the target's size
    dram: float  # bytes / s at 512 MiB
    target_bytes: int
    draft_bytes: int

    @classmethod
    def measure(cls, bundle: Path, manifest, context: int) -> Floor:
        drafter = "draft" if manifest.draft is not None else "head"  # a bundle without a draft model drafts with its head
        target, draft = (call_bytes(bundle, manifest, m, context) for m in ("target", drafter))
        return cls(read_bandwidth(target), read_bandwidth(512 * 2**20, repeats=3), target, draft)

    @property
    def target_call(self) -> float:
        return self.target_bytes / self.bandwidth

    @property
    def draft_call(self) -> float:
        return self.draft_bytes / self.bandwidth

    def seconds(self, target_calls: int, draft_calls: int) -> float:
        """The floor of a decode that made these calls."""
        return target_calls * self.target_call + draft_calls * self.draft_call

    def line(self) -> str:
        return (f"bandwidth floor: weights stream at {self.bandwidth / 1e9:.1f} GB/s (DRAM {self.dram / 1e9:.1f}); a target call reads {self.target_bytes / 2**20:.1f} MiB "
                f"({self.target_call * 1e3:.2f} ms), a draft call {self.draft_bytes / 2**20:.2f} MiB ({self.draft_call * 1e3:.3f} ms): "
                f"autoregressive decoding cannot pass {1 / self.target_call:.0f} tok/s")  # fmt: skip

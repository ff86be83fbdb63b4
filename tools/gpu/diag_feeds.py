"""Feeds for a graph of a bundle in the GPU diagnostics (tools/gpu/diag_*.py): random token ids,
positions 0..S-1, lengths for an empty cache, zero KV buffers; the same on every provider."""

import numpy as np


def feeds(inputs: list[dict], rows: int, s: int = 3, high: int = 5000, seed: int = 0) -> dict[str, np.ndarray]:
    """``inputs``: a manifest graph's input specs; ``rows`` rows of ``s`` new tokens each."""
    rng = np.random.default_rng(seed)
    out = {}
    for t in inputs:
        n = t["name"]
        if n == "input_ids":
            out[n] = rng.integers(100, high, (rows, s)).astype(np.int64)  # [B, S]
        elif n == "position_ids":
            out[n] = np.tile(np.arange(s), (rows, 1)).astype(np.int64)  # [B, S]
        elif n == "seqlens_k":
            out[n] = np.full((rows,), s - 1, np.int32)  # [B]: rows visible - 1
        elif n.startswith("total_sequence_length"):
            out[n] = np.array(s, np.int32)  # []
        else:
            out[n] = np.zeros(t["shape"], dtype=t["dtype"])  # a KV buffer [1, kvH, MAX, D]
    return out

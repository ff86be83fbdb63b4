"""What the GPU diagnostics (tools/gpu/diag_*.py) share: their arguments, and feeds for a graph
of a bundle (random token ids, positions 0..S-1, lengths for an empty cache, zero KV buffers;
the same on every provider)."""

import argparse
from pathlib import Path

import numpy as np


def stamp() -> dict:
    """The provenance a diagnostic's JSON carries (the commit is added here, from the call's tree)."""
    import datetime
    import sys

    return {"command": "python " + " ".join(sys.argv), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def args(doc: str) -> tuple[Path, Path]:
    """(bundle, out folder) from the command line: ``python tools/gpu/diag_X.py BUNDLE OUT``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path, help="a float16 bundle (the check's, unpacked on the device)")
    ap.add_argument("out", type=Path, help="where the JSON goes ($OUT on the device)")
    a = ap.parse_args()
    return a.bundle, a.out


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

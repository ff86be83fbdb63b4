#!/usr/bin/env python3
"""One bundle graph: median call time and the resident memory its ONNX Runtime session adds,
with MatMul weight prepacking on or off (issue 29: whether the batched engine could hold its
weights once by not prepacking).

    python tools/bench_prepack.py BUNDLE/target_batch8.onnx on|off

Feeds zeros (one new token per row over 255 past rows), 2 intra-op threads; prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import onnxruntime as ort

DTYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32}
PAST_ROWS = 255


def rss_mib() -> float:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) / 1024


def feeds_for(session: ort.InferenceSession) -> dict[str, np.ndarray]:
    """Zeros for every input, dynamic dims as 1; positions and seqlens_k at PAST_ROWS."""
    out = {}
    for i in session.get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in i.shape]
        fill = PAST_ROWS if i.name in ("seqlens_k", "position_ids") else 0
        out[i.name] = np.full(shape, fill, dtype=DTYPES[i.type])
    return out


def main(path: str, prepacking: bool) -> dict:
    before = rss_mib()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    if not prepacking:
        options.add_session_config_entry("session.disable_prepacking", "1")
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    loaded = rss_mib()
    feeds = feeds_for(session)
    session.run(["logits"], feeds)  # warm-up
    times = []
    for _ in range(8):
        t0 = time.perf_counter()
        session.run(["logits"], feeds)
        times.append(time.perf_counter() - t0)
    return {"graph": os.path.basename(path), "prepacking": prepacking, "ms": 1e3 * float(np.median(times)),
            "session_mib": loaded - before, "after_call_mib": rss_mib() - before}


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[2] not in ("on", "off"):
        sys.exit(__doc__)
    print(json.dumps(main(sys.argv[1], sys.argv[2] == "on")))

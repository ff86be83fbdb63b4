#!/usr/bin/env python3
"""What a verify call's extra rows cost in each weight format's matrix product, on this CPU.

Speculation pays when a call over 1 + γ tokens costs about one token's call. At batch 1 a
float32 matrix product streams its weights once, whatever the rows. This tool times, for the
formats a quantized bundle can run its weights in, a stack of SmolLM2-135M's matrix shapes (30
layers of up 576 -> 1536 and down 1536 -> 576, distinct weights: ~53 MB at 8 bits, past this
CPU's L2, as a real call's are) at M = 1..8 rows, and reports each M's cost over M = 1:

    float32                  MatMul
    q8_0 / q4_0 MatMulNBits  ONNX Runtime's, accuracy_level 4 (int8 activations per block of 32):
                             ``--kernel nbits`` (not row-invariant)
    q8_0 / q4_0 / q4_1       specdec's MatMulBlocks (engines/csrc/blocks.c), row-invariant:
      blocks                 ``--quantize int8|int4``'s default

    python tools/bench_int8_rows.py --out docs/bench/real-model/int8-rows
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FORMATS = ("float32", "q8_0 MatMulNBits", "q4_0 MatMulNBits", "q8_0 blocks", "q4_0 blocks", "q4_1 blocks")
ROWS = (1, 2, 3, 4, 5, 8)


def stack(fmt: str, layers: int, width: int, inner: int, rows: int, seed: int = 0) -> bytes:
    """x [rows, width] through ``layers`` (up [width, inner], down [inner, width]) pairs in ``fmt``."""
    import onnx
    from onnx import TensorProto, helper

    from specdec.engines import blocks_op
    from specdec.export import blocks

    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for i in range(2 * layers):
        k, n = (width, inner) if i % 2 == 0 else (inner, width)
        w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
        out = f"y{i}"
        recipe = fmt.split()[0]
        if fmt == "float32":
            inits.append(onnx.numpy_helper.from_array(w, f"w{i}"))
            nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [out]))
        elif fmt.endswith("MatMulNBits"):
            codes, scale = blocks.q8_0(w) if recipe == "q8_0" else blocks.q4_0(w)
            codes = codes if recipe == "q8_0" else blocks.pack_nibbles(codes)
            inits += [onnx.numpy_helper.from_array(codes, f"w{i}"), onnx.numpy_helper.from_array(scale.reshape(-1), f"s{i}")]
            nodes.append(helper.make_node("MatMulNBits", [x, f"w{i}", f"s{i}"], [out], domain="com.microsoft", K=k, N=n,
                                          bits=8 if recipe == "q8_0" else 4, block_size=32, accuracy_level=4))  # fmt: skip
        else:
            inits.append(onnx.numpy_helper.from_array(blocks.column_blocks(w, recipe), f"w{i}"))
            nodes.append(helper.make_node(blocks_op.OP, [x, f"w{i}"], [out], domain=blocks_op.DOMAIN, K=k, N=n, format=blocks_op.FORMATS[recipe]))
        x = out
    graph = helper.make_graph(nodes, "stack", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, width])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [rows, width])], inits)  # fmt: skip
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1), helper.make_opsetid(blocks_op.DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def session(model: bytes, threads: int):
    import onnxruntime as ort

    from specdec.engines import blocks_op

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    blocks_op.register(opts)
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--width", type=int, default=576)
    ap.add_argument("--inner", type=int, default=1536)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=60, help="timed calls per (format, rows), after 10 warm-up calls")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, formats interleaved; the median call of all")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    import onnxruntime as ort

    from specdec.bench.report import write_results

    sessions = {(f, m): session(stack(f, args.layers, args.width, args.inner, m), args.threads) for f in FORMATS for m in ROWS}
    feeds = {m: {"x": np.random.default_rng(m).standard_normal((m, args.width)).astype(np.float32)} for m in ROWS}
    times: dict[tuple, list[float]] = {key: [] for key in sessions}
    for _ in range(args.rounds):
        for (f, m), s in sessions.items():
            for _ in range(10):
                s.run(None, feeds[m])
            for _ in range(args.calls):
                t = time.perf_counter()
                s.run(None, feeds[m])
                times[(f, m)].append(time.perf_counter() - t)
    rows = []
    for f in FORMATS:
        one = statistics.median(times[(f, 1)])
        for m in ROWS:
            ms = statistics.median(times[(f, m)])
            rows.append({"format": f, "rows": m, "ms": round(1e3 * ms, 3), "vs_one_row": round(ms / one, 3)})
    md = [f"{args.layers} x (up {args.width}->{args.inner}, down {args.inner}->{args.width}), {args.threads} threads, ONNX Runtime {ort.__version__}: "
          "ms per call (median), and as a multiple of the same format's 1-row call", "",
          "| format | " + " | ".join(f"M = {m}" for m in ROWS) + " |", "|---|" + "---:|" * len(ROWS)]  # fmt: skip
    for f in FORMATS:
        cells = [next(r for r in rows if r["format"] == f and r["rows"] == m) for m in ROWS]
        md.append(f"| {f} | " + " | ".join(f"{c['ms']:.2f} ({c['vs_one_row']:.2f}x)" for c in cells) + " |")
    text = "\n".join(md) + "\n"
    print(text)
    write_results(args.out, text, {"rows": rows, "config": vars(args) | {"out": str(args.out), "onnxruntime": ort.__version__}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

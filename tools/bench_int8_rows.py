#!/usr/bin/env python3
"""What a verify call's extra rows cost in each weight format's matrix product, on this CPU.

Speculation pays when a call over 1 + γ tokens costs about one token's call. At batch 1 a
float32 matrix product streams its weights once, whatever the rows. This tool times, for the
formats ONNX Runtime runs int8 weights in, a stack of SmolLM2-135M's matrix shapes (30 layers
of up 576 -> 1536 and down 1536 -> 576, distinct weights: ~53 MB at 8 bits, past this CPU's
caches, as a real call's are) at M = 1..5 rows, and reports each M's cost over M = 1:

    float32         MatMul
    q8_0 / q4_0     MatMulNBits, accuracy_level 4 (int8 activations per block of 32): what
                    ``--quantize int8/int4`` exports (export/quantize.py)
    per-column int8 DynamicQuantizeMatMul (one scale per output column, activations with one
                    scale per call): ``--quantize dynamic-int8``'s kernel
    per-row int8    per-column int8 weights, activations quantized per row by ONNX ops, then
                    MatMulInteger (u8 x s8): row-independent, as a verify call must be
    q8_0 int8 GEMM  q8_0's blocks as one batched MatMulInteger per block of 32, activations per
                    block and row (llama.cpp's Q8_0 x Q8_0 arithmetic in ONNX ops)

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

FORMATS = ("float32", "q8_0", "q4_0", "per-column int8", "per-row int8", "q8_0 int8 GEMM")
ROWS = (1, 2, 3, 4, 5)


def _const(name: str, value, dtype) -> "onnx.NodeProto":  # noqa: F821
    from onnx import helper, numpy_helper

    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(value, dtype)))


def rowwise_int8(x: str, w: str, s: str, out: str, p: str) -> list:
    """out = x @ w (x [.., M, K], w [.., K, N] int8) with x's last axis quantized per row (symmetric 8-bit codes stored as uint8 +
    128: MatMulInteger's u8 x s8 kernel; its s8 x s8 one is ~6x slower here), w int8 codes, s
    the weights' scales (broadcast over out)."""
    from onnx import helper

    node = lambda op, ins, o, **kw: helper.make_node(op, ins, [p + o], **kw)  # noqa: E731
    return [_const(p + "eps", 1e-30, np.float32), _const(p + "127", 127.0, np.float32), _const(p + "128", 128.0, np.float32),
            _const(p + "zp", 128, np.uint8),
            node("Abs", [x], "abs"), node("ReduceMax", [p + "abs"], "max", axes=[-1], keepdims=1),
            node("Max", [p + "max", p + "eps"], "max2"), node("Div", [p + "max2", p + "127"], "scale"),  # [.., 1]: one scale per row
            node("Div", [x, p + "scale"], "x"), node("Round", [p + "x"], "round"), node("Add", [p + "round", p + "128"], "u"),
            node("Cast", [p + "u"], "codes", to=2), node("MatMulInteger", [p + "codes", w, p + "zp"], "int"),
            node("Cast", [p + "int"], "f", to=1), node("Mul", [p + "f", p + "scale"], "g"), helper.make_node("Mul", [p + "g", s], [out])]  # fmt: skip


def blocked_int8(x: str, w: str, s: str, out: str, p: str, k: int) -> list:
    """x [M, K] @ q8_0 blocks: w [K/32, 32, N] int8, s [K/32, 1, N]; x quantized per row and block
    of 32, one batched product per block, summed over blocks."""
    from onnx import helper

    return [_const(f"{p}shape", [-1, k // 32, 32], np.int64), _const(f"{p}axis0", [0], np.int64),
            helper.make_node("Reshape", [x, f"{p}shape"], [f"{p}xb"]), helper.make_node("Transpose", [f"{p}xb"], [f"{p}xt"], perm=[1, 0, 2]),
            *rowwise_int8(f"{p}xt", w, s, f"{p}blocks", p),  # [K/32, M, N]
            helper.make_node("ReduceSum", [f"{p}blocks", f"{p}axis0"], [out], keepdims=0)]  # fmt: skip


def per_column(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [K, N] -> int8 codes [K, N] and float32 scales [N], one per output column."""
    scale = (np.abs(w).max(axis=0) / 127).astype(np.float32)
    return np.clip(np.rint(w / scale), -127, 127).astype(np.int8), scale


def stack(fmt: str, layers: int, width: int, inner: int, rows: int, seed: int = 0) -> bytes:
    """x [rows, width] through ``layers`` (up [width, inner], down [inner, width]) pairs in ``fmt``."""
    import onnx
    from onnx import TensorProto, helper

    from specdec.export import blocks

    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for i in range(2 * layers):
        k, n = (width, inner) if i % 2 == 0 else (inner, width)
        w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
        out = f"y{i}"
        if fmt == "float32":
            inits.append(onnx.numpy_helper.from_array(w, f"w{i}"))
            nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [out]))
        elif fmt in ("q8_0", "q4_0"):
            codes, scale = blocks.q8_0(w) if fmt == "q8_0" else blocks.q4_0(w)
            codes = codes if fmt == "q8_0" else blocks.pack_nibbles(codes)
            inits += [onnx.numpy_helper.from_array(codes, f"w{i}"), onnx.numpy_helper.from_array(scale.reshape(-1), f"s{i}")]
            nodes.append(helper.make_node("MatMulNBits", [x, f"w{i}", f"s{i}"], [out], domain="com.microsoft", K=k, N=n,
                                          bits=8 if fmt == "q8_0" else 4, block_size=32, accuracy_level=4))  # fmt: skip
        elif fmt == "per-row int8":
            codes, scale = per_column(w)
            inits += [onnx.numpy_helper.from_array(codes, f"w{i}"), onnx.numpy_helper.from_array(scale, f"s{i}")]
            nodes += rowwise_int8(x, f"w{i}", f"s{i}", out, f"r{i}")
        elif fmt == "q8_0 int8 GEMM":
            codes, scale = blocks.q8_0(w)  # codes [n, k/32, 32] uint8 (+128), scale [n, k/32]
            wq = (codes.astype(np.int16) - 128).astype(np.int8).transpose(1, 2, 0).copy()  # [k/32, 32, n]
            ws = scale.reshape(n, k // 32).T.reshape(k // 32, 1, n).astype(np.float32)  # [k/32, 1, n]
            inits += [onnx.numpy_helper.from_array(wq, f"w{i}"), onnx.numpy_helper.from_array(ws, f"s{i}")]
            nodes += blocked_int8(x, f"w{i}", f"s{i}", out, f"r{i}", k)
        else:
            codes, scale = per_column(w)
            inits += [onnx.numpy_helper.from_array(codes, f"w{i}"), onnx.numpy_helper.from_array(scale, f"s{i}"),
                      onnx.numpy_helper.from_array(np.zeros(n, np.int8), f"z{i}")]  # fmt: skip
            nodes.append(helper.make_node("DynamicQuantizeMatMul", [x, f"w{i}", f"s{i}", f"z{i}"], [out], domain="com.microsoft"))
        x = out
    graph = helper.make_graph(nodes, "stack", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, width])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [rows, width])], inits)  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return model.SerializeToString()


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

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args.threads
    sessions = {(f, m): ort.InferenceSession(stack(f, args.layers, args.width, args.inner, m), opts, providers=["CPUExecutionProvider"])
                for f in FORMATS for m in ROWS}  # fmt: skip
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

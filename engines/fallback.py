"""A graph made for specdec's kernels, where their library is missing: the same weights on ONNX
Runtime's own ops, so an int8/int4 bundle still runs (without the row invariance that makes its
greedy speculative output equal to autoregressive token for token: docs/exactness.md).

``MatMulBlocks`` becomes ``MatMulNBits`` over the very same blocks (Q8_0 and Q4_0 re-laid out;
Q4_1's minimum as a float32 residual, export/quantize.py's ``--kernel nbits`` recipe), and
``ai.specdec``'s GroupQueryAttention becomes ``com.microsoft``'s (the same inputs). The rewritten
graph is written once, under the cache folder (``$SPECDEC_CACHE``), keyed by the graph file's
path, size and time: the bundle itself is never written to. This needs the ``onnx`` package
(``pip install onnx``, part of ``specdec[export]``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

from specdec.engines import blocks_op
from specdec.errors import EngineError

WARNING = ("specdec's kernel library is not built in this install: int8/int4 graphs run on ONNX Runtime's MatMulNBits, whose verify "
           "rows are not row-invariant (greedy speculative output may part from autoregressive at a close call); re-install specdec "
           "where gcc or clang is present for token-for-token equality")  # fmt: skip


def _cache() -> Path:
    from specdec.integrity import cache_root

    return cache_root() / "nbits"


def nbits_graph(bundle: Path, file: str) -> Path:
    """``bundle / file`` with specdec's ops replaced by ONNX Runtime's (made once, then reused)."""
    src = Path(bundle) / file
    st = src.stat()
    key = hashlib.sha256(f"{src.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:20]
    out = _cache() / key / src.name
    if out.exists():
        return out
    try:
        import onnx
    except ImportError:
        raise EngineError(f"graph {file} needs specdec's kernel library, which this install lacks, or the onnx package to run it on "
                          "ONNX Runtime's MatMulNBits instead: pip install onnx (or re-install specdec where gcc or clang is present)") from None  # fmt: skip
    model = onnx.load(str(src))
    rewrite(model)
    out.parent.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent.parent, prefix=".staging-"))
    try:
        onnx.save_model(model, str(staging / src.name), save_as_external_data=True, location=src.name + ".data")
        os.replace(staging, out.parent)  # whole or not at all: a second process may have won the race (then ours is dropped)
    except OSError:
        if not out.exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def rewrite(model) -> int:
    """Replace ``model``'s ai.specdec nodes (in every subgraph) in place; returns how many."""
    import numpy as np
    import onnx

    from specdec.export.blocks import dequantize_column_blocks, ungated_blocks
    from specdec.export.quantize import PRECISIONS, Blocked

    recipes = {v: k for k, v in blocks_op.FORMATS.items()}
    inits = {t.name: t for t in model.graph.initializer}
    blocked = Blocked(replace(PRECISIONS["int8"], kernel="nbits"))
    count = 0

    def graph(g) -> None:
        nonlocal count
        nodes = list(g.node)
        out: list = []
        for node in nodes:
            for a in node.attribute:
                for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    graph(sub)
            if node.domain != blocks_op.DOMAIN:
                out.append(node)
                continue
            count += 1
            if node.op_type != blocks_op.OP:  # GroupQueryAttention: the same op in ONNX Runtime's domain
                node.domain = "com.microsoft"
                out.append(node)
                continue
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            recipe, n, blob = recipes[attrs["format"]], attrs["N"], onnx.numpy_helper.to_array(inits[node.input[1]])
            blocked.scope()  # this node's rewrite, in this graph's scope
            if attrs.get("gated"):  # silu(x @ gate) * (x @ up) as the exporter wrote it before export/gated.py folded it
                w = dequantize_column_blocks(ungated_blocks(blob), recipe, attrs["K"], n=2 * n)  # [K, 2N]
                both, out_name = node.output[0] + "_gate_up", node.output[0]
                product = onnx.helper.make_node(node.op_type, node.input, [both], name=node.name)
                blocked.rewrite(product, w, recipe)
                sizes = blocked.const(node.input[1] + "_sizes", np.array([n, n], np.int64))
                gate, up, sig, silu = (f"{both}_{part}" for part in ("gate", "up", "sigmoid", "silu"))
                blocked.nodes += [onnx.helper.make_node("Split", [both, sizes], [gate, up], axis=-1), onnx.helper.make_node("Sigmoid", [gate], [sig]),
                                  onnx.helper.make_node("Mul", [gate, sig], [silu]), onnx.helper.make_node("Mul", [silu, up], [out_name])]  # fmt: skip
            else:
                blocked.rewrite(node, dequantize_column_blocks(blob, recipe, attrs["K"], n=n), recipe)  # [K, N]
            out.extend(blocked.nodes)
        del g.node[:]
        g.node.extend(out)

    graph(model.graph)
    used = {i for n in _all_nodes(model.graph) for i in n.input}
    kept = [t for t in model.graph.initializer if t.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept + blocked.inits)
    opsets = [o for o in model.opset_import if o.domain != blocks_op.DOMAIN]
    if not any(o.domain == "com.microsoft" for o in opsets):
        opsets.append(onnx.helper.make_opsetid("com.microsoft", 1))
    del model.opset_import[:]
    model.opset_import.extend(opsets)
    return count


def _all_nodes(g):
    for node in g.node:
        yield node
        for a in node.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                yield from _all_nodes(sub)

"""The target's row-move graph (role "move"): a tree's accepted path compacted where the KV lives.

A verified tree leaves its nodes' KV rows at [length, length + N); the accepted path's rows
must follow the committed ones (``KVCache.keep``). On host buffers NumPy moves them; a device
cache (CUDA) cannot be indexed from Python, so the bundle carries this graph, which ONNX
Runtime runs where the cache is, over the very buffers the decoding graphs write:

    per layer and tensor, past [1, kvH, MAX, D] bound to the cache, present bound to the same buffer
      rows    = Gather(past, rows_from, axis=2)                      [1, kvH, m, D]: read first
      present = ScatterElements(past, expand(rows_to), rows, axis=2)  rows_to[k] <- rows_from[k]

``rows_from`` / ``rows_to`` int64 [m] (absolute positions; the manifest's ``ids`` / ``positions``
roles). The rows are gathered into a buffer of their own before any is written, so a row
moved down never overwrites one still to be read; ScatterElements starts from ``past`` in
``present`` (bound to the same buffer, that is the cache itself) and writes the moved rows.
No weights, standard ops: nothing to optimize or quantize. A bundle with this graph needs a
specdec that knows the role (this one on).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from specdec.errors import ExportError
from specdec.manifest import GraphIO, GraphSpec, TensorSpec

FROM, TO = "rows_from", "rows_to"
ONNX_TYPES = {"float32": onnx.TensorProto.FLOAT, "float16": onnx.TensorProto.FLOAT16}


def export_kv_move(path: Path, layers: int, kv_heads: int, max_seq: int, head_dim: int, dtype: str):
    """Write the move graph for a cache of ``layers`` × (key, value) [1, kvH, MAX, D] to ``path``;
    returns (inputs, outputs, io)."""
    kv = (1, kv_heads, max_seq, head_dim)
    past = tuple((f"past_key_{i}", f"past_value_{i}") for i in range(layers))
    present = tuple((f"present_key_{i}", f"present_value_{i}") for i in range(layers))
    inputs = [TensorSpec(FROM, "int64", ("M",)), TensorSpec(TO, "int64", ("M",))] + [TensorSpec(n, dtype, kv) for pair in past for n in pair]
    outputs = [TensorSpec(n, dtype, kv) for pair in present for n in pair]
    nodes = [helper.make_node("Reshape", [TO, "shape_to"], ["to_4d"], name="to_4d")]  # [1, 1, m, 1]
    for x, y in zip((n for pair in past for n in pair), (n for pair in present for n in pair)):
        nodes += [helper.make_node("Gather", [x, FROM], [f"{x}_rows"], name=f"{x}_gather", axis=2),  # [1, kvH, m, D]
                  helper.make_node("Shape", [f"{x}_rows"], [f"{x}_shape"], name=f"{x}_shape"),
                  helper.make_node("Expand", ["to_4d", f"{x}_shape"], [f"{x}_to"], name=f"{x}_expand"),
                  helper.make_node("ScatterElements", [x, f"{x}_to", f"{x}_rows"], [y], name=f"{x}_scatter", axis=2)]  # fmt: skip
    info = lambda t: helper.make_tensor_value_info(t.name, ONNX_TYPES.get(t.dtype, onnx.TensorProto.INT64), list(t.shape))  # noqa: E731
    graph = helper.make_graph(nodes, "kv_move", [info(t) for t in inputs], [info(t) for t in outputs],
                              [helper.make_tensor("shape_to", onnx.TensorProto.INT64, [4], [1, 1, -1, 1])])  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return inputs, outputs, GraphIO(FROM, TO, None, past, present)


def validate_kv_move(bundle: Path, graph: tuple[str, GraphSpec], seed: int = 0) -> None:
    """Run the move graph over random host buffers and compare with ``KVCache.keep`` (NumPy):
    an ExportError unless every row is where keep puts it, bit for bit."""
    from specdec.engines.kv import KVCache
    from specdec.engines.move import RowMover
    from specdec.engines.sessions import open_session

    name, g = graph
    _, kv_heads, max_seq, head_dim = g.inputs[2].shape
    layers = len(g.io.past)
    rng = np.random.default_rng(seed)
    host, device = (KVCache(layers, kv_heads, max_seq, head_dim, g.inputs[2].dtype, d) for d in ("cpu", "ortvalue"))
    for buf, other in zip((*host.keys, *host.values), (*device.keys, *device.values)):
        buf[:] = rng.standard_normal(buf.shape)
        other.update_inplace(buf)
    rows = sorted(rng.choice(np.arange(1, min(16, max_seq - 4)), size=3, replace=False).tolist())  # a path with gaps
    host.length = device.length = 4
    host.keep([0, *rows])
    RowMover(open_session(bundle, name, g), name, g).keep(device, [0, *rows])
    for want, got in zip((*host.keys, *host.values), (*device.keys, *device.values)):
        if not np.array_equal(want, got.numpy()):
            raise ExportError(f"graph {name} moved KV rows {rows} wrong; the export is broken")

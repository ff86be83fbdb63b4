"""One batched graph per model for every row count: the weights in memory once for the batched engine.

``export/batched.py`` traces a graph per row count B (1, 2, 4, .., --max-batch): its attention
runs one batch-1 GQA per row, so B is unrolled into the graph. Each graph opened as its own
ONNX Runtime session holds its own pre-packed copy of the weights (the mapped file is shared;
the packed MatMul operands are not, and ORT's Python API cannot share them across sessions),
so an engine of 8 rows held the weights four times (docs/performance.md).

This module merges a model's per-B graphs into one. Each body B sits in its own top-level If,
taken when the leading dimension of ``input_ids`` is B; every body reads the same top-level
initializers, so the session packs each weight once (ORT shares packed weights between a
graph and its subgraphs):

    input_ids [B, S] ─► Shape[0] ─► If B == 1: body 1 │ else: pass 1 ─► logits/rows1, present_*/rows1
                                    If B == 2: body 2 │ else: pass 2 ─► logits/rows2, present_*/rows2
                                    ...                                  (the largest body: unsuffixed)
    past_key_i_b / past_value_i_b [1, kvH, MAX, D] for b < Bmax

Body B's outputs are the per-B graph's, renamed by ``body_output`` (manifest.py). A body not
taken returns empty tensors (one Constant), which the runtime does not fetch: it binds only
the taken body's outputs, present_* of row r onto the buffers of the slot row r serves, so GQA
still writes each row's KV in place (engines/batch.py keeps one I/O binding per body). The Ifs
are side by side, never nested: a nested If's outputs were copied out (measured, 3.5 ms a call
on the demo pair). What remains is a cost per If output a call does not use, ~2-6 us each
(docs/performance.md).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from specdec.errors import ExportError
from specdec.manifest import GraphIO, GraphSpec, TensorSpec, body_output


def _tensor_key(t: onnx.TensorProto) -> tuple:
    """Identity of an initializer's value: its external-data range, or a digest of its bytes."""
    if t.data_location == onnx.TensorProto.EXTERNAL:
        info = {e.key: e.value for e in t.external_data}
        return ("external", t.data_type, tuple(t.dims), info["location"], info.get("offset", "0"), info.get("length"))
    body = onnx.TensorProto()
    body.CopyFrom(t)
    body.name = ""
    return ("inline", hashlib.sha256(body.SerializeToString()).hexdigest())


class _Initializers:
    """The merged graph's initializers: each distinct value once, under a name unique to it."""

    def __init__(self):
        self.by_key: dict[tuple, str] = {}
        self.tensors: list[onnx.TensorProto] = []
        self.names: set[str] = set()

    def add(self, t: onnx.TensorProto) -> str:
        key = _tensor_key(t)
        if key not in self.by_key:
            name, k = t.name, 0
            while name in self.names:
                k += 1
                name = f"{t.name}__{k}"
            copy = onnx.TensorProto()
            copy.CopyFrom(t)
            copy.name = name
            self.tensors.append(copy)
            self.names.add(name)
            self.by_key[key] = name
        return self.by_key[key]


def _body(graph: onnx.GraphProto, rows: int, outer: set[str], inits: _Initializers) -> tuple[onnx.GraphProto, onnx.GraphProto]:
    """The per-B graph as the then-branch of its If (graph inputs read from the outer scope,
    initializers from the merged set, other values prefixed), and its else-branch."""
    prefix = f"rows{rows}/"
    rename = {t.name: inits.add(t) for t in graph.initializer} | {name: name for name in outer}
    nodes = []
    for n in graph.node:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
            raise ExportError(f"batched graph of {rows} rows has a {n.op_type} node with a subgraph; the rows merge takes flat graphs only")
        node = onnx.NodeProto()
        node.CopyFrom(n)
        del node.input[:], node.output[:], node.metadata_props[:]
        node.input.extend(rename.get(i, prefix + i) if i else i for i in n.input)
        node.output.extend(prefix + o if o else o for o in n.output)
        node.name = prefix + (n.name or f"{n.op_type}_{len(nodes)}")
        nodes.append(node)
    then = helper.make_graph(nodes, f"rows{rows}", [], [helper.make_tensor_value_info(prefix + o.name, o.type.tensor_type.elem_type, None)
                                                        for o in graph.output])  # fmt: skip
    passed, outs = [], []
    for o in graph.output:  # not taken: every output an empty tensor of its type, unfetched
        elem = o.type.tensor_type.elem_type
        name = f"pass{rows}/empty{elem}"
        if not any(n.output[0] == name for n in passed):
            passed.append(helper.make_node("Constant", [], [name], value=helper.make_tensor(name, elem, [0], []), name=name))
        outs.append(helper.make_tensor_value_info(name, elem, None))
    return then, helper.make_graph(passed, f"pass{rows}", [], outs)


def merge_rows(folder: Path, specs: dict[int, GraphSpec], out: str) -> GraphSpec:
    """Merge one model's batched graphs ``specs`` (rows -> spec, files in ``folder``, at least
    two) into ``folder / out``; returns its spec (``rows``: the bodies' sizes). The per-B files
    are left for the caller to remove."""
    sizes = sorted(specs)
    if len(sizes) < 2:
        raise ExportError(f"merging batched graphs needs two row counts or more, got {sizes}")
    top = specs[sizes[-1]]
    protos = {b: onnx.load(str(folder / specs[b].file), load_external_data=False) for b in sizes}
    opsets = {b: sorted((o.domain, o.version) for o in p.opset_import) for b, p in protos.items()}
    if len({tuple(v) for v in opsets.values()}) != 1:
        raise ExportError(f"batched graphs {sizes} import different opsets {opsets}; they must come from one exporter run")
    inputs, outputs, io = signature(specs)
    outer = {t.name for t in inputs}
    inits = _Initializers()
    nodes = [helper.make_node("Shape", [io.ids], ["rows/count"], start=0, end=1, name="rows/count")]
    for b in sizes:
        then, otherwise = _body(protos[b].graph, b, outer, inits)
        value = helper.make_tensor(f"rows/{b}", onnx.TensorProto.INT64, [1], [b])
        nodes += [helper.make_node("Constant", [], [f"rows/{b}"], value=value, name=f"rows/const{b}"),
                  helper.make_node("Equal", ["rows/count", f"rows/{b}"], [f"rows/is{b}"], name=f"rows/is{b}"),
                  helper.make_node("If", [f"rows/is{b}"], [body_output(o.name, b, sizes[-1]) for o in protos[b].graph.output],
                                   then_branch=then, else_branch=otherwise, name=f"rows/if{b}")]  # fmt: skip
    src = protos[sizes[-1]]
    graph = helper.make_graph(nodes, Path(out).stem, [_value_info(t) for t in inputs], [_value_info(t) for t in outputs], inits.tensors)
    model = helper.make_model(graph, opset_imports=list(src.opset_import), producer_name="specdec", ir_version=src.ir_version)
    onnx.save(model, str(folder / out))
    return GraphSpec(out, "", top.model, top.role, None, inputs, outputs, io, top.data, top.flavour, sizes[-1], tuple(sizes))


def _value_info(t: TensorSpec) -> onnx.ValueInfoProto:
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(t.dtype))
    return helper.make_tensor_value_info(t.name, elem, list(t.shape))


def signature(specs: dict[int, GraphSpec]) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...], GraphIO]:
    """The merged graph's inputs (the largest body's, rows dimension B) and outputs (every
    body's, renamed by ``body_output``), and the I/O roles under the largest body's names."""
    sizes = sorted(specs)
    top = specs[sizes[-1]]
    kv = {n for pair in (*top.io.past, *top.io.present, *top.io.cross) for n in pair}  # a row's own buffers: [1, ...]

    def symbolic(t: TensorSpec, name: str | None = None) -> TensorSpec:
        shape = t.shape if t.name in kv or not t.shape else ("B", *t.shape[1:])  # a row's scalar (its total) stays one
        return TensorSpec(name or t.name, t.dtype, shape)

    outputs = [symbolic(t, body_output(t.name, b, sizes[-1])) for b in sizes for t in specs[b].outputs]
    return tuple(symbolic(t) for t in top.inputs), tuple(outputs), top.io

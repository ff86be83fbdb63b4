"""Reads and edits of an ONNX graph that the optimization passes share (export/optimize.py)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


def attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    out: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            out.setdefault(i, []).append(n)
    return out


def producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in graph.node for o in n.output}


def reads(node: onnx.NodeProto) -> set[str]:
    """Names a node reads: its inputs, and what the subgraphs of an If/Loop read from outside."""
    out = set(node.input)
    for a in node.attribute:
        for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
            out |= {i for n in g.node for i in reads(n)}
    return out


def prune(graph: onnx.GraphProto) -> None:
    """Drop nodes whose outputs nobody reads (repeat until stable)."""
    while True:
        used = {i for n in graph.node for i in reads(n)} | {o.name for o in graph.output}
        keep = [n for n in graph.node if any(o in used for o in n.output)]
        if len(keep) == len(graph.node):
            return
        del graph.node[:]
        graph.node.extend(keep)


def constant(graph: onnx.GraphProto, name: str) -> np.ndarray | None:
    """The value of ``name`` where it is an initializer or a Constant node's output."""
    for t in graph.initializer:
        if t.name == name:
            return numpy_helper.to_array(t)
    for n in graph.node:
        if n.op_type == "Constant" and n.output[0] == name:
            a = attrs(n)
            return numpy_helper.to_array(a["value"]) if "value" in a else np.asarray(a["value_ints"]) if "value_ints" in a else None
    return None


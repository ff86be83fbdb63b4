"""The packing passes of export/optimize.py (6-8 of its docstring): sibling MatMuls on one
concatenated weight, attention reading the packed q/k/v itself, and the Reshape after it gone."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from specdec.export.onnx_graph import attrs, constant, consumers, producers, prune, reads


def pack_sibling_matmuls(model: onnx.ModelProto) -> int:
    """MatMul(x, W1), MatMul(x, W2), ... -> Split(MatMul(x, [W1 | W2 | ...])); returns groups packed."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    uses: dict[str, int] = {}
    for n in graph.node:
        for i in n.input:
            uses[i] = uses.get(i, 0) + 1
    groups: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        w = inits.get(n.input[1]) if n.op_type == "MatMul" else None
        if w is not None and len(w.dims) == 2 and uses[w.name] == 1 and w.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
            groups.setdefault(n.input[0], []).append(n)
    packed = 0
    for x, nodes in groups.items():
        if len(nodes) < 2 or len({inits[n.input[1]].dims[0] for n in nodes}) != 1:
            continue
        weights = [numpy_helper.to_array(inits[n.input[1]]) for n in nodes]
        name = nodes[0].name + "_packed"
        graph.initializer.append(numpy_helper.from_array(np.concatenate(weights, axis=1), name + "_W"))
        sizes = numpy_helper.from_array(np.array([w.shape[1] for w in weights], dtype=np.int64), name + "_sizes")
        graph.initializer.append(sizes)
        first = list(graph.node).index(nodes[0])
        graph.node.insert(first, helper.make_node("Split", [name + "_out", sizes.name], [n.output[0] for n in nodes], axis=-1, name=name + "_split"))
        graph.node.insert(first, helper.make_node("MatMul", [x, name + "_W"], [name + "_out"], name=name))
        for n in nodes:
            graph.initializer.remove(inits[n.input[1]])
            graph.node.remove(n)
        packed += 1
    return packed


def _reshape_keeps_last(graph: onnx.GraphProto, node: onnx.NodeProto, rows: int | None, width: int) -> bool:
    """Reshape ``node`` maps a [rows, S, width] tensor to [rows, -1, width]: to itself."""
    shape = constant(graph, node.input[1]) if node.op_type == "Reshape" else None
    if shape is None or rows is None or shape.ndim != 1 or len(shape) != 3:
        return False
    return shape[0] in (rows, 0) and shape[1] == -1 and shape[2] == width


def _batch_rows(graph: onnx.GraphProto) -> int | None:
    """The graph's static batch rows, from its first past_key input [B, kvH, MAX, D]."""
    past = next((i for i in graph.input if i.name.startswith("past_key")), None)
    dim = past.type.tensor_type.shape.dim[0] if past is not None else None
    return dim.dim_value if dim is not None and dim.HasField("dim_value") else None


def _head_size(graph: onnx.GraphProto, gqa: onnx.NodeProto) -> int:
    """D of ``gqa``'s past_key [B, kvH, MAX, D] where it is a graph input with static shape; else 0."""
    past = next((i for i in graph.input if i.name == gqa.input[3]), None) if len(gqa.input) > 3 else None
    dims = past.type.tensor_type.shape.dim if past is not None else []
    return dims[3].dim_value if len(dims) == 4 and dims[3].HasField("dim_value") else 0


def pack_qkv_into_attention(model: onnx.ModelProto) -> int:
    """Pass 7 of export/optimize.py's docstring; returns how many attentions read packed QKV. Biases
    (Qwen2's q/k/v) come along: Add(Split(x), b_i) -> Add(x, [b_q | b_k | b_v]) before the attention."""
    graph = model.graph
    prod, cons = producers(graph), consumers(graph)
    rows = _batch_rows(graph)
    done, old_biases = 0, set()
    for gqa in [n for n in graph.node if n.op_type == "GroupQueryAttention" and len(n.input) >= 3 and all(n.input[:3])]:
        a = attrs(gqa)
        h, kvh = a["num_heads"], a["kv_num_heads"]
        reshape = prod.get(gqa.input[2])
        reshape = reshape if reshape is not None and reshape.op_type == "Reshape" else None
        heads = [gqa.input[0], gqa.input[1], reshape.input[0] if reshape else gqa.input[2]]
        adds = [prod.get(t) for t in heads]
        biases = [constant(graph, n.input[1]) if n is not None and n.op_type == "Add" else None for n in adds]
        if all(b is not None and b.ndim == 1 for b in biases):
            heads = [n.input[0] for n in adds]
        elif any(b is not None for b in biases):
            continue
        else:
            adds = []
        split = prod.get(heads[0])
        if split is None or split.op_type != "Split" or list(split.output) != heads or attrs(split).get("axis") not in (-1, 2):
            continue
        sizes = constant(graph, split.input[1]) if len(split.input) > 1 else None
        d = int(sizes[0]) // h if sizes is not None and len(sizes) == 3 else 0
        if not d or sizes.tolist() != [h * d, kvh * d, kvh * d] or (adds and [len(b) for b in biases] != sizes.tolist()):
            continue
        between = [*split.output, *(n.output[0] for n in adds)]
        if any(len(cons.get(t, [])) != 1 for t in between) or (reshape and (len(cons[reshape.output[0]]) != 1 or not _reshape_keeps_last(graph, reshape, rows, kvh * d))):
            continue
        packed = split.input[0]
        if adds:
            bias = numpy_helper.from_array(np.concatenate(biases), gqa.name + "_qkv_bias")
            graph.initializer.append(bias)
            packed = gqa.name + "_qkv"
            graph.node.insert(list(graph.node).index(split), helper.make_node("Add", [split.input[0], bias.name], [packed], name=gqa.name + "_qkv_add"))
        gqa.input[0], gqa.input[1], gqa.input[2] = packed, "", ""
        old_biases.update(n.input[1] for n in adds)
        for n in (split, reshape, *adds):
            if n is not None:
                graph.node.remove(n)
        done += 1
    prune(graph)
    read = {i for n in graph.node for i in reads(n)}
    for t in [t for t in graph.initializer if t.name in old_biases and t.name not in read]:
        graph.initializer.remove(t)
    return done


def drop_attention_reshapes(model: onnx.ModelProto) -> int:
    """Pass 8 of export/optimize.py's docstring; returns how many Reshapes went."""
    graph = model.graph
    prod, cons = producers(graph), consumers(graph)
    rows, outputs = _batch_rows(graph), {o.name for o in graph.output}
    done = 0
    for r in [n for n in graph.node if n.op_type == "Reshape"]:
        gqa = prod.get(r.input[0])
        if gqa is None or gqa.op_type != "GroupQueryAttention" or gqa.output[0] != r.input[0] or len(cons[r.input[0]]) != 1:
            continue
        d = _head_size(graph, gqa)
        if not d or r.output[0] in outputs or not _reshape_keeps_last(graph, r, rows, attrs(gqa)["num_heads"] * d):
            continue
        for n in cons.get(r.output[0], []):
            for i, name in enumerate(n.input):
                if name == r.output[0]:
                    n.input[i] = r.input[0]
        graph.node.remove(r)
        done += 1
    return done


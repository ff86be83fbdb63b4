"""The target's features: the hidden state its LM head reads (or, for an EAGLE-3 head, what it
makes of the residual streams entering chosen layers), as one more output of every target graph.

A feature drafter (export/head.py) drafts from the target's own last hidden state, the
input of the LM head, at every fed position. Every target graph already computes it; this
pass only names it as an output:

    logits <- (Mul / Tanh / Div / Cast: soft-capping, scaling) <- MatMul-like head (h, W)
    features := Cast(h, float32)     [B, S, d], B and S as the graph's logits (a float16 graph's too)

Found by walking back from ``logits`` through element-wise ops to the first head product
(MatMul, FusedMatMul, Gemm, MatMulNBits, MatMulBlocks), so it holds for every family, tied or untied head,
float or quantized, and for every graph kind (dynamic, fixed-length, batched, tree, portable)
without exporting anything again: the weights are untouched.

An EAGLE-3 head (export/eagle3.py) reads other features, built the same way: ``stream_into``
finds the residual stream entering a layer by structure (the full-width norm behind that
layer's attention), ``fused`` computes fc(norm?(concat(streams))) from them, and ``streams``
returns the raw concatenation its training reads.
"""

from __future__ import annotations

import re

import onnx
from onnx import helper

from specdec.errors import ExportError
from specdec.manifest import body_output

FEATURES = "features"
HEAD_OPS = {"MatMul", "FusedMatMul", "Gemm", "MatMulNBits", "MatMulBlocks"}
PASS_THROUGH = {"Mul", "Div", "Tanh", "Cast", "Identity", "Add", "Softcap"}


def head_input(graph: onnx.GraphProto, logits: str) -> tuple[str, onnx.NodeProto]:
    """The tensor the LM head reads (the features) and the head node, walking back from ``logits``."""
    producer = {o: n for n in graph.node for o in n.output}
    inits = {i.name for i in graph.initializer}
    name = logits
    for _ in range(16):
        node = producer.get(name)
        if node is None:
            break
        if node.op_type in HEAD_OPS:
            return node.input[0], node
        if node.op_type not in PASS_THROUGH:
            break
        name = next((i for i in node.input if i in producer and i not in inits), None)
        if name is None:
            break
    raise ValueError(f"no LM head product (one of {sorted(HEAD_OPS)}) found behind output {logits!r}")


def expose(proto: onnx.ModelProto, logits: str, width: int, rows: tuple[int, ...] = (), make=None) -> None:
    """Add the ``features`` output [B, S, width] (B, S: the logits' own dims) to ``proto``, in
    place. A rows graph (export/rows.py; ``rows``: its bodies) gets it in every body.
    ``make(graph, logits, name, dims)`` adds the nodes computing them in a graph (``dims``: the
    top graph's initializers' shapes, which a rows body reads; default: the LM
    head's input, ``identity``; EAGLE-3's fused layers: ``fused``)."""
    graph = proto.graph
    if any(o.name == FEATURES for o in graph.output):
        return
    for b in rows or (0,):
        name = body_output(FEATURES, b, rows[-1]) if rows else FEATURES
        source = body_output(logits, b, rows[-1]) if rows else logits
        _produce(graph, source, name, make or identity, {t.name: tuple(t.dims) for t in graph.initializer})
        out = next(o for o in graph.output if o.name == source)
        dims = list(out.type.tensor_type.shape.dim)[:-1]
        shape = [d.dim_param if d.dim_param else d.dim_value for d in dims] + [width]
        graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape))


def _produce(graph: onnx.GraphProto, logits: str, name: str, make, dims: dict) -> None:
    """Make ``graph`` compute the features behind ``logits`` as ``name``. A rows graph's body
    (an If: export/rows.py) computes them in its then-branch; its else-branch (the body not
    taken) returns its empty float tensor for them too."""
    node = next((n for n in graph.node if logits in n.output), None)
    if node is not None and node.op_type == "If":
        at = list(node.output).index(logits)
        branches = {a.name: a.g for a in node.attribute}
        then, otherwise = branches["then_branch"], branches["else_branch"]
        inner = f"{then.name}/{FEATURES}"
        _produce(then, then.output[at].name, inner, make, dims)
        then.output.append(helper.make_tensor_value_info(inner, onnx.TensorProto.FLOAT, None))
        otherwise.output.append(otherwise.output[at])  # the logits' empty float tensor
        node.output.append(name)
        return
    make(graph, logits, name, dims)


def identity(graph: onnx.GraphProto, logits: str, name: str, dims: dict) -> None:
    """``name`` := the LM head's input, as float32 (a float16 graph's too)."""
    hidden, _ = head_input(graph, logits)
    graph.node.append(as_float(hidden, name, f"specdec_{name.replace('/', '_')}"))


def as_float(x: str, out: str, name: str) -> onnx.NodeProto:
    """``out`` := ``x`` as float32: the features are float32 in every graph, the runtime's host
    buffers; in a float32 graph the Cast is a no-op that ONNX Runtime removes."""
    return helper.make_node("Cast", [x], [out], name=name, to=onnx.TensorProto.FLOAT)


NORMS = {"SimplifiedLayerNormalization", "LayerNormalization", "SkipSimplifiedLayerNormalization", "SkipLayerNormalization"}


def stream_into(graph: onnx.GraphProto, layer: int, layers: int, logits: str, width: int, dims: dict) -> str:
    """The residual stream [.., ``width``] entering decoder layer ``layer`` (``layers``: the final norm's input),
    found by structure, not by weight names (identical norms share one initializer): layer i's
    attention is the GroupQueryAttention writing ``present_key_<i>`` (a rows graph's body: one per
    row, ``present_key_<i>_<row>``, all reading one norm), and the norm its query is
    computed from reads the stream; the LM head's own norm reads the last one. A fused
    skip-norm sums its input and skip: that sum is named (its fourth output) or added here."""
    producer = {o: n for n in graph.node for o in n.output if o}
    if layer == layers:
        node = producer.get(head_input(graph, logits)[0])
    else:
        attn = next((n for n in graph.node if n.op_type == "GroupQueryAttention" and any(re.search(rf"present_key_{layer}(_\d+)?$", o) for o in n.output)), None)
        node = _norm_behind(attn.input[0], producer, lambda n: dims.get(n.input[2 if n.op_type.startswith('Skip') else 1]) == (width,)) if attn is not None else None
    if node is None or node.op_type not in NORMS:
        raise ExportError(f"the residual stream into layer {layer} was not found (no norm before its attention); "
                          "EAGLE-3 heads need a pre-norm target (llama, qwen, mistral families) exported for ONNX Runtime")
    if not node.op_type.startswith("Skip"):
        return node.input[0]
    if len(node.output) > 3 and node.output[3]:
        return node.output[3]
    out = f"{node.name}_stream"
    if out not in producer:
        graph.node.append(helper.make_node("Add", list(node.input[:2]), [out], name=f"{node.name}_stream_add"))
    if len(node.input) > 3 and node.input[3]:  # a bias, added after the skip as the fused op does
        if out + "_b" not in producer:
            graph.node.append(helper.make_node("Add", [out, node.input[3]], [out + "_b"], name=f"{node.name}_stream_bias"))
        out += "_b"
    return out


def _norm_behind(name: str, producer: dict, wide, depth: int = 12) -> onnx.NodeProto | None:
    """The nearest norm over the whole width (``wide(node)``: not a per-head q/k norm) behind
    ``name``, breadth first over computed inputs (the projections, their packing and splits, a
    rotary applied outside the attention op)."""
    level, seen = [name], {name}
    for _ in range(depth):
        nodes = [producer[n] for n in level if n in producer]
        found = next((n for n in nodes if n.op_type in NORMS and wide(n)), None)
        if found is not None or not nodes:
            return found
        level = [i for n in nodes for i in n.input if i in producer and i not in seen]
        seen.update(level)
    return None


def streams(layer_ids: tuple[int, ...], layers: int, width: int):
    """A ``make`` for ``expose``: [the LM head's input, the streams entering ``layer_ids``], width
    (1 + k)·d: what an EAGLE-3 head trains on (export/eagle3_train.py): the target's own features
    for its distribution, the streams for its fc."""

    def make(graph: onnx.GraphProto, logits: str, name: str, dims: dict) -> None:
        parts = [head_input(graph, logits)[0], *(stream_into(graph, i, layers, logits, width, dims) for i in layer_ids)]
        tag = f"specdec_{name.replace('/', '_')}"
        graph.node.append(helper.make_node("Concat", parts, [f"{tag}_cat"], name=f"{tag}_streams", axis=-1))
        graph.node.append(as_float(f"{tag}_cat", name, f"{tag}_float"))

    return make


def fused(layer_ids: tuple[int, ...], layers: int, width: int, eps: float, names: dict[str, str]):
    """A ``make`` for ``expose``: EAGLE-3's fused feature fc(norm?(concat(streams))) (export/eagle3.py),
    reading the initializers ``names`` ("fc", and "input_norm" or "fc_norm.<i>") the caller adds."""

    def make(graph: onnx.GraphProto, logits: str, name: str, dims: dict) -> None:
        tag = f"specdec_{name.replace('/', '_')}"
        parts = [stream_into(graph, i, layers, logits, width, dims) for i in layer_ids]
        graph.node.extend(as_float(p, f"{tag}_f{k}", f"{tag}_float{k}") for k, p in enumerate(parts))  # float32 weights below
        parts = [f"{tag}_f{k}" for k in range(len(parts))]
        if "fc_norm.0" in names:
            for k, s in enumerate(parts):
                graph.node.append(helper.make_node("SimplifiedLayerNormalization", [s, names[f"fc_norm.{k}"]], [f"{tag}_n{k}"],
                                                   name=f"{tag}_norm{k}", axis=-1, epsilon=eps, stash_type=1))  # fmt: skip
            parts = [f"{tag}_n{k}" for k in range(len(parts))]
        graph.node.append(helper.make_node("Concat", parts, [f"{tag}_cat"], name=f"{tag}_cat", axis=-1))
        x = f"{tag}_cat"
        if "input_norm" in names:
            graph.node.append(helper.make_node("SimplifiedLayerNormalization", [x, names["input_norm"]], [f"{tag}_normed"],
                                               name=f"{tag}_input_norm", axis=-1, epsilon=eps, stash_type=1))  # fmt: skip
            x = f"{tag}_normed"
        graph.node.append(helper.make_node("MatMul", [x, names["fc"]], [name], name=f"{tag}_fc"))

    return make

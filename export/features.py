"""The target's features: the hidden state its LM head reads, as one more output of every target graph.

A feature drafter (export/head.py) drafts from the target's own last hidden state, the
input of the LM head, at every fed position. Every target graph already computes it; this
pass only names it as an output:

    logits <- (Mul / Tanh / Div / Cast: soft-capping, scaling) <- MatMul-like head (h, W)
    features := Identity(h)          float32 [B, S, d], B and S as the graph's logits

Found by walking back from ``logits`` through element-wise ops to the first head product
(MatMul, FusedMatMul, Gemm, MatMulNBits, MatMulBlocks), so it holds for every family, tied or untied head,
float or quantized, and for every graph kind (dynamic, fixed-length, batched, tree, portable)
without exporting anything again: the weights are untouched.
"""

from __future__ import annotations

import onnx
from onnx import helper

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


def expose(proto: onnx.ModelProto, logits: str, width: int, rows: tuple[int, ...] = ()) -> None:
    """Add the ``features`` output [B, S, width] (B, S: the logits' own dims) to ``proto``, in
    place. A rows graph (export/rows.py; ``rows``: its bodies) gets it in every body."""
    graph = proto.graph
    if any(o.name == FEATURES for o in graph.output):
        return
    for b in rows or (0,):
        name = body_output(FEATURES, b, rows[-1]) if rows else FEATURES
        source = body_output(logits, b, rows[-1]) if rows else logits
        _produce(graph, source, name)
        out = next(o for o in graph.output if o.name == source)
        dims = list(out.type.tensor_type.shape.dim)[:-1]
        shape = [d.dim_param if d.dim_param else d.dim_value for d in dims] + [width]
        graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape))


def _produce(graph: onnx.GraphProto, logits: str, name: str) -> None:
    """Make ``graph`` compute the features behind ``logits`` as ``name``. A rows graph's body
    (an If: export/rows.py) computes them in its then-branch; its else-branch (the body not
    taken) returns its empty float tensor for them too."""
    node = next((n for n in graph.node if logits in n.output), None)
    if node is not None and node.op_type == "If":
        at = list(node.output).index(logits)
        branches = {a.name: a.g for a in node.attribute}
        then, otherwise = branches["then_branch"], branches["else_branch"]
        inner = f"{then.name}/{FEATURES}"
        _produce(then, then.output[at].name, inner)
        then.output.append(helper.make_tensor_value_info(inner, onnx.TensorProto.FLOAT, None))
        otherwise.output.append(otherwise.output[at])  # the logits' empty float tensor
        node.output.append(name)
        return
    hidden, _ = head_input(graph, logits)
    graph.node.append(helper.make_node("Identity", [hidden], [name], name=f"specdec_{name.replace('/', '_')}"))

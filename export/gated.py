"""A gated MLP's first half in one ``MatMulBlocks`` node: silu(x @ gate) * (x @ up).

The exporter writes Llama-style MLPs as one product over the gate and up projections side by
side, then ``Split`` → ``Sigmoid`` → ``Mul`` (SiLU) → ``Mul`` by the up half: four small nodes a
layer whose cost is mostly ONNX Runtime's per-node overhead at one token (0.6 ms of a 10 ms
int8 SmolLM2-135M call, plus their share of the time between kernels: `specdec bench --op-split`).
Here they fold into the product: its weights re-laid as the two halves' panels in turn
(``export/blocks.py`` ``gated_blocks``) and ``gated=1``, the kernel applying the SiLU product to
each output panel as it leaves the registers (engines/csrc/blocks.c). A row's result still
depends on that row alone. Other activations (Gemma's GELU) are left as they are.
"""

from __future__ import annotations

from collections import defaultdict

import onnx
from onnx import helper, numpy_helper

from specdec.engines.blocks_op import DOMAIN, OP
from specdec.export.blocks import PANEL, gated_blocks


def fuse_gated_mlps(graph: onnx.GraphProto) -> int:
    """Fold every ``MatMulBlocks`` → Split → SiLU → Mul chain of ``graph`` into its product; returns
    how many. A chain is folded only when nothing else reads its intermediate values."""
    consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            consumers[name].append(node)
    inits = {t.name: t for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    dropped: set[int] = set()
    replaced: dict[str, onnx.TensorProto] = {}
    for node in graph.node:
        chain = _chain(node, consumers, inits, outputs)
        if chain is None:
            continue
        split, sigmoid, silu, product = chain
        half = _attr(node, "N") // 2
        blob = inits[node.input[1]]
        replaced[blob.name] = numpy_helper.from_array(gated_blocks(numpy_helper.to_array(blob)), blob.name)
        for a in node.attribute:
            if a.name == "N":
                a.i = half
        node.attribute.append(helper.make_attribute("gated", 1))
        node.output[0] = product.output[0]
        dropped |= {id(split), id(sigmoid), id(silu), id(product)}
    if not replaced:
        return 0
    kept = [n for n in graph.node if id(n) not in dropped]
    del graph.node[:]
    graph.node.extend(kept)
    tensors = [replaced.get(t.name, t) for t in graph.initializer]
    del graph.initializer[:]
    graph.initializer.extend(tensors)
    return len(replaced)


def _attr(node: onnx.NodeProto, name: str):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), None)


def _only(consumers: dict, name: str, op: str) -> onnx.NodeProto | None:
    found = consumers.get(name, [])
    return found[0] if len(found) == 1 and found[0].op_type == op and found[0].domain == "" else None


def _chain(node, consumers, inits, outputs) -> tuple | None:
    """(split, sigmoid, silu, product) when ``node`` starts a foldable gated MLP, else None."""
    if node.op_type != OP or node.domain != DOMAIN or _attr(node, "gated") or node.input[1] not in inits:
        return None
    n = _attr(node, "N")
    if n % (2 * PANEL) or len(consumers[node.input[1]]) != 1:
        return None
    split = _only(consumers, node.output[0], "Split")
    if split is None or len(split.output) != 2 or _attr(split, "axis") != -1 or _split_sizes(split, inits) != [n // 2, n // 2]:
        return None
    gate, up = split.output
    uses = consumers.get(gate, [])
    sigmoid = next((c for c in uses if c.op_type == "Sigmoid" and c.domain == ""), None)
    silu = next((c for c in uses if c.op_type == "Mul" and c.domain == "" and sigmoid is not None and set(c.input) == {gate, sigmoid.output[0]}), None)
    if sigmoid is None or silu is None or len(uses) != 2 or len(consumers.get(sigmoid.output[0], [])) != 1:
        return None
    product = _only(consumers, silu.output[0], "Mul")
    if product is None or set(product.input) != {silu.output[0], up} or len(consumers.get(up, [])) != 1:
        return None
    if outputs & {node.output[0], gate, up, sigmoid.output[0], silu.output[0]}:
        return None
    return split, sigmoid, silu, product


def _split_sizes(split: onnx.NodeProto, inits: dict) -> list[int] | None:
    if len(split.input) > 1 and split.input[1]:
        t = inits.get(split.input[1])
        return [int(v) for v in numpy_helper.to_array(t)] if t is not None else None
    sizes = _attr(split, "split")
    return [int(v) for v in sizes] if sizes is not None else None

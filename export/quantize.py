"""Dynamic int8 weight quantization for CPU (ONNX Runtime's quantize_dynamic), in place."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx
from onnx import helper


def _gemm_to_matmul(model: onnx.ModelProto) -> None:
    """Rewrite Gemm(transB=1) as MatMul + Add on a transposed constant weight.

    quantize_dynamic's shape inference trips over OPT's Gemm(transB=1) nodes; MatMul is what
    it quantizes best anyway.
    """
    inits = {t.name: t for t in model.graph.initializer}
    nodes = []
    for node in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        weight = inits.get(node.input[1]) if node.op_type == "Gemm" and len(node.input) > 1 else None
        if weight is None or attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
            nodes.append(node)
            continue
        if attrs.get("transB", 0):
            arr = onnx.numpy_helper.to_array(weight).T.copy()
            weight.CopyFrom(onnx.numpy_helper.from_array(arr, weight.name))
        mm_out = node.output[0] + "_mm" if len(node.input) > 2 else node.output[0]
        nodes.append(helper.make_node("MatMul", node.input[:2], [mm_out], name=node.name + "_mm"))
        if len(node.input) > 2:
            nodes.append(helper.make_node("Add", [mm_out, node.input[2]], [node.output[0]], name=node.name + "_add"))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    del model.graph.value_info[:]


def quantize_int8(path: Path) -> None:
    """Replace ``path`` (and its ``.data``) with a dynamically int8-quantized graph."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(path))
    _gemm_to_matmul(model)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        staged = Path(tmp) / "float.onnx"
        onnx.save(model, str(staged), save_as_external_data=True, location="float.onnx.data")
        for old in (path, path.with_name(path.name + ".data")):
            old.unlink(missing_ok=True)
        quantize_dynamic(
            str(staged),
            str(path),
            weight_type=QuantType.QInt8,
            per_channel=True,
            use_external_data_format=True,
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
        )


def external_files(path: Path) -> tuple[str, ...]:
    """The external-data files a graph references, relative to its folder."""
    model = onnx.load(str(path), load_external_data=False)
    found = {
        entry.value
        for t in model.graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
        for entry in t.external_data
        if entry.key == "location"
    }
    return tuple(sorted(found))


@dataclass(frozen=True)
class WeightOnly:
    """How one precision stores MatMul weights: a block recipe of ``export/blocks.py`` for the
    block matrices (``body``) and for the LM head (``head``, the MatMul that makes the logits),
    run by ONNX Runtime's ``MatMulNBits``.

    kernel: "blocks" runs them with specdec's ``MatMulBlocks`` (engines/csrc/: GGUF's own blocks,
        Q4_1's minimum included, each row's bits independent of the call's other rows); "nbits"
        with ONNX Runtime's ``MatMulNBits`` (Q4_1's minimum as a float32 residual; rows of a verify
        call can differ from a 1-row call at an int8 rounding boundary: docs/exactness.md).
    accuracy_level: MatMulNBits only. 4 computes with int8 activations quantized per block (MLAS's
        fast CPU path, as llama.cpp's Q4_1 x Q8_1 dot products); 0 in float32 (slow on CPU).
    """

    body: str
    head: str = "q8_0"
    block_size: int = 32
    accuracy_level: int = 4
    kernel: str = "blocks"

    def __post_init__(self) -> None:
        if self.kernel not in ("blocks", "nbits"):
            raise ValueError(f"kernel {self.kernel!r}: expected blocks (specdec's MatMulBlocks) or nbits (ONNX Runtime's MatMulNBits)")
        if self.kernel == "blocks" and self.block_size != 32:
            raise ValueError(f"block_size {self.block_size} with the blocks kernel: GGUF's blocks are 32 wide; use kernel='nbits'")


# Chosen on a real model (SmolLM2-135M-Instruct, docs/quantization.md), one change at a time:
# symmetric blocks or rounded zero points (ONNX Runtime's quantizer) lose the model at int4;
# llama.cpp's own recipes keep it, and give back a GGUF's Q4_1/Q8_0 blocks exactly.
PRECISIONS = {
    "int8": WeightOnly(body="q8_0"),
    "int4": WeightOnly(body="q4_1"),
}


def scheme_for(kind: str, gguf_types: tuple[str, ...] = (), kernel: str = "blocks") -> WeightOnly:
    """``kind``'s scheme for a source whose GGUF tensor types are ``gguf_types`` (() for other
    sources), run by ``kernel``: int4 of a file whose 4-bit matrices are Q4_0 (and none Q4_1) takes
    the q4_0 recipe, which gives its blocks back exactly (q4_1 would move them onto another grid)."""
    s = replace(PRECISIONS[kind], kernel=kernel)
    if kind == "int4" and "Q4_0" in gguf_types and "Q4_1" not in gguf_types:
        return replace(s, body="q4_0")
    return s


def head_matmuls(model: onnx.ModelProto, output: str = "logits") -> list[str]:
    """Names of the MatMul nodes with a constant weight nearest upstream of ``output``: the LM head."""
    inits = {t.name for t in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    todo, seen, found = [output], set(), []
    while todo:
        node = producer.get(todo.pop())
        if node is None or node.name in seen:
            continue
        seen.add(node.name)
        if node.op_type == "MatMul" and len(node.input) > 1 and node.input[1] in inits:
            found.append(node.name)
            continue
        todo.extend(node.input)
    return found


class Blocked:
    """MatMul nodes rewritten as MatMulNBits by one scheme; new nodes and initializers collect here."""

    def __init__(self, scheme: WeightOnly):
        self.s = scheme
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.sums: dict[str, str] = {}  # input name -> its block sums [.., K/block]
        self.indicators: dict[int, str] = {}  # K -> the [K, K/block] 0/1 matrix that sums blocks
        self.made: set[str] = set()  # constants already written: a weight shared by several MatMuls is stored once

    def scope(self) -> None:
        """Start another graph scope (a subgraph): its nodes and block sums apart, the constants shared."""
        self.nodes, self.sums = [], {}

    def const(self, name: str, arr: np.ndarray) -> str:
        if name not in self.made:
            self.made.add(name)
            self.inits.append(onnx.numpy_helper.from_array(arr, name))
        return name

    def _block_sums(self, x: str, k: int) -> str:
        """x [.., K] -> [.., K/block]: one MatMul by a 0/1 matrix shared by every input of width K."""
        if x not in self.sums:
            if k not in self.indicators:
                ind = np.kron(np.eye(k // self.s.block_size, dtype=np.float32), np.ones((self.s.block_size, 1), np.float32))
                self.indicators[k] = self.const(f"block_sum_{k}x{k // self.s.block_size}", ind)  # [K, K/block]
            self.sums[x] = f"{x}_block_sums"
            self.nodes.append(helper.make_node("MatMul", [x, self.indicators[k]], [self.sums[x]], name=f"{x}_block_sums"))
        return self.sums[x]

    def rewrite(self, node: onnx.NodeProto, w: np.ndarray, recipe: str) -> None:
        from specdec.export import blocks

        k, n = w.shape
        if self.s.kernel == "blocks":
            from specdec.engines.blocks_op import DOMAIN, FORMATS, OP

            ins = [node.input[0], self.const(node.input[1] + f"_{recipe}", blocks.column_blocks(w, recipe, self.s.block_size))]
            self.nodes.append(helper.make_node(OP, ins, list(node.output), name=node.name + f"_{recipe}", domain=DOMAIN, K=k, N=n,
                                               format=FORMATS[recipe]))  # fmt: skip
            return
        x, base, out = node.input[0], node.input[1], node.output[0]
        attrs = dict(K=k, N=n, block_size=self.s.block_size, accuracy_level=self.s.accuracy_level)
        if recipe == "q8_0":
            codes, scale = blocks.q8_0(w, self.s.block_size)
            ins = [x, self.const(base + "_q8", codes), self.const(base + "_scale", scale.reshape(-1))]
            self.nodes.append(helper.make_node("MatMulNBits", ins, [out], name=node.name + "_q8", domain="com.microsoft", bits=8, **attrs))
            return
        if recipe == "q4_0":
            codes, scale = blocks.q4_0(w, self.s.block_size)
            ins = [x, self.const(base + "_q4", blocks.pack_nibbles(codes)), self.const(base + "_scale", scale.reshape(-1))]
            self.nodes.append(helper.make_node("MatMulNBits", ins, [out], name=node.name + "_q4", domain="com.microsoft", bits=4, **attrs))
            return
        if recipe != "q4_1":
            raise ValueError(f"unknown block recipe {recipe!r}; expected q4_0, q4_1 or q8_0")
        codes, scale, minimum = blocks.q4_1(w, self.s.block_size)
        z, r = blocks.split_minimum(scale, minimum)
        ins = [x, self.const(base + "_q4", blocks.pack_nibbles(codes)), self.const(base + "_scale", scale.reshape(-1)),
               self.const(base + "_zp", blocks.pack_zero_points(z).reshape(-1))]  # fmt: skip
        self.nodes.append(helper.make_node("MatMulNBits", ins, [out + "_int"], name=node.name + "_q4", domain="com.microsoft", bits=4, **attrs))
        rest = self.const(base + "_residual", np.ascontiguousarray(r.T))  # [K/block, N]: min - scale * z per block
        self.nodes.append(helper.make_node("MatMul", [self._block_sums(x, k), rest], [out + "_res"], name=node.name + "_res"))
        self.nodes.append(helper.make_node("Add", [out + "_int", out + "_res"], [out], name=node.name + "_add"))


def _used_names(graph: onnx.GraphProto) -> set[str]:
    """Every value name a node of ``graph`` (or of its subgraphs) reads."""
    used = set()
    for node in graph.node:
        used.update(node.input)
        for a in node.attribute:
            for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                used |= _used_names(g)
    return used


def row_invariant_attention(graph: onnx.GraphProto) -> int:
    """GroupQueryAttention nodes specdec's own op can run (no position_ids, no attention bias:
    every graph but trees' and encoder-decoders') moved to the ``ai.specdec`` domain, whose kernel
    gives each row the same bits at every call width (engines/csrc/attention.c); returns how many."""
    from specdec.engines.blocks_op import DOMAIN

    moved = 0
    for node in graph.node:
        if node.op_type == "GroupQueryAttention" and node.domain == "com.microsoft" and not any(node.input[9:]):
            node.domain = DOMAIN
            moved += 1
    return moved


def quantize_weight_only(path: Path, kind: str, scheme: WeightOnly | None = None) -> None:
    """Replace ``path`` (and its ``.data``) with a graph whose MatMul weights are stored in
    blocks by ``kind``'s scheme (``PRECISIONS``, or ``scheme``) and run by its kernel
    (``MatMulBlocks`` or ONNX Runtime's ``MatMulNBits``); activations, embeddings, norms and the
    KV cache stay float32.
    A MatMul whose K is not a multiple of the block size stays float32."""
    s = scheme or PRECISIONS[kind]
    model = onnx.load(str(path))
    _gemm_to_matmul(model)
    head = set(head_matmuls(model))
    inits = {t.name: t for t in model.graph.initializer}
    out = Blocked(s)
    for node in model.graph.node:
        w = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if w is None or len(w.dims) != 2 or w.dims[0] % s.block_size or w.data_type != onnx.TensorProto.FLOAT:
            out.nodes.append(node)
        else:
            out.rewrite(node, onnx.numpy_helper.to_array(w), s.head if node.name in head else s.body)
    del model.graph.node[:]
    model.graph.node.extend(out.nodes)
    if s.kernel == "blocks":  # the activations the blocks quantize, computed alike at every call width
        row_invariant_attention(model.graph)
    used = _used_names(model.graph) | {o.name for o in model.graph.output}
    kept = [t for t in model.graph.initializer if t.name in used]  # float weights now unused are dropped
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept + out.inits)
    if s.kernel == "blocks":  # a gated MLP's SiLU product into its first product (export/gated.py)
        from specdec.export.gated import fuse_gated_mlps

        fuse_gated_mlps(model.graph)
    from specdec.engines.blocks_op import DOMAIN

    domain = "com.microsoft" if s.kernel == "nbits" else DOMAIN
    if not any(o.domain == domain for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(domain, 1))
    for old in (path, path.with_name(path.name + ".data")):
        old.unlink(missing_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, location=path.name + ".data")

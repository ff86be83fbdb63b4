"""Dynamic int8 weight quantization for CPU (ONNX Runtime's quantize_dynamic), in place."""

from __future__ import annotations

import tempfile
from pathlib import Path

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


WEIGHT_ONLY_BITS = {"int8": 8, "int4": 4}
BLOCK_SIZE = 32  # weights per scale along K, as onnxruntime-genai's CPU int4 models
ACCURACY_LEVEL = 4  # MatMulNBits computes with int8 activations: the fast CPU path (genai's default on CPU)


def quantize_weight_only(path: Path, kind: str) -> None:
    """Replace ``path`` (and its ``.data``) with a graph whose MatMul weights are block-wise
    symmetric ``kind`` ("int8" or "int4"), run by ONNX Runtime's ``MatMulNBits``; activations,
    embeddings, norms and the KV cache stay float32."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.load(str(path))
    _gemm_to_matmul(model)
    quantizer = MatMulNBitsQuantizer(model, bits=WEIGHT_ONLY_BITS[kind], block_size=BLOCK_SIZE, is_symmetric=True,
                                     accuracy_level=ACCURACY_LEVEL, op_types_to_quantize=("MatMul",))  # fmt: skip
    quantizer.process()
    for old in (path, path.with_name(path.name + ".data")):
        old.unlink(missing_ok=True)
    onnx.save_model(quantizer.model.model, str(path), save_as_external_data=True, location=path.name + ".data")

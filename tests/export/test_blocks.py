"""Block quantization (export/blocks.py, export/quantize.py): llama.cpp's recipes, checked against
the gguf package's own Q4_1/Q8_0 codecs, and the MatMulNBits graphs ONNX Runtime runs from them."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from specdec.engines import blocks_op
from specdec.export import blocks
from specdec.export.quantize import PRECISIONS, WeightOnly, head_matmuls, quantize_weight_only, scheme_for

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType


def weights(k: int, n: int, seed: int = 0) -> np.ndarray:
    """[K, N] with a spread of block ranges (some blocks all positive), as real weights have."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(np.float32) * rng.uniform(0.01, 0.2, size=(k // 32, 1, n)).repeat(32, 0).reshape(k, n)
    w[:32, :4] = np.abs(w[:32, :4]) + 0.05  # blocks with min > 0: their zero point clips, the residual carries it
    return w.astype(np.float32)


def gguf_roundtrip(w: np.ndarray, qtype) -> np.ndarray:
    """w [K, N] through a GGUF block type: blocks along K (the row of a GGUF tensor of shape [N, K])."""
    return gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(w.T), qtype), qtype).T


def test_q4_1_gives_back_a_q4_1_file_and_matches_its_codec():
    """On a Q4_1 file's weights the recipe is idempotent (the file's own blocks come back, to fp32
    rounding: ~1 ulp of the scale per code); on float weights it gives what gguf's Q4_1 gives."""
    w = weights(128, 48)
    q41 = gguf_roundtrip(w, T.Q4_1)
    again = blocks.dequantize_q4_1(*blocks.q4_1(q41))
    assert np.abs(again - q41).max() <= 1e-6 * np.abs(q41).max()
    ours = blocks.dequantize_q4_1(*blocks.q4_1(w))
    # gguf stores scale and minimum in float16; ours are float32: agree to float16 rounding
    assert np.abs(ours - q41).max() <= 2e-3 * np.abs(w).max()


def test_q4_0_gives_back_a_q4_0_file_and_matches_its_codec():
    w = weights(128, 48, seed=6)
    q40 = gguf_roundtrip(w, T.Q4_0)
    codes, scale = blocks.q4_0(q40)
    assert np.abs(blocks.dequantize_q4_0(codes, scale) - q40).max() <= 1e-6 * np.abs(q40).max()
    assert np.abs(blocks.dequantize_q4_0(*blocks.q4_0(w)) - q40).max() <= 2e-3 * np.abs(w).max()  # float16 scales in the file
    # the q4_1 recipe on the same weights moves them onto another grid: the loss the q4_0 choice avoids
    assert np.abs(blocks.dequantize_q4_1(*blocks.q4_1(q40)) - q40).max() > 1e-2 * np.abs(q40).max()


def test_scheme_follows_the_gguf_block_type():
    assert scheme_for("int4").body == "q4_1" and scheme_for("int4", ("F32", "Q4_1", "Q8_0")).body == "q4_1"
    assert scheme_for("int4", ("F32", "Q4_0", "Q8_0")).body == "q4_0"
    assert scheme_for("int8", ("Q4_0",)).body == "q8_0"


def test_q8_0_gives_back_a_q8_0_file():
    w = weights(96, 40, seed=1)
    q80 = gguf_roundtrip(w, T.Q8_0)
    codes, scale = blocks.q8_0(q80)
    assert codes.min() >= 1 and codes.max() <= 255  # -127..127 stored + 128
    assert np.abs(blocks.dequantize_q8_0(codes, scale) - q80).max() <= 1e-6 * np.abs(q80).max()


def test_split_minimum_is_exact():
    codes, scale, minimum = blocks.q4_1(weights(64, 24))
    z, r = blocks.split_minimum(scale, minimum)
    assert z.max() <= 15
    a = (codes.astype(np.float32) - z[..., None]) * scale[..., None] + r[..., None]
    b = codes.astype(np.float32) * scale[..., None] + minimum[..., None]
    assert np.abs(a - b).max() <= 1e-6 * np.abs(b).max()
    inside = (minimum <= 0) & (minimum + 15 * scale >= 0)  # zero point in range: residual within half a step
    assert np.all(np.abs(r[inside]) <= scale[inside] / 2 * (1 + 1e-5))


def matmul_model(k: int, n: int, w: np.ndarray, head: bool) -> onnx.ModelProto:
    """x [B, S, K] @ w, then (head=True) named ``logits``; else a Relu after it."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y" if not head else "logits"], name="mm")]
    out = "logits" if head else "z"
    if not head:
        nodes.append(helper.make_node("Relu", ["y"], ["z"], name="relu"))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", k])],
                          [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["b", "s", n])], [numpy_helper.from_array(w, "w")])  # fmt: skip
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("accuracy_level", [0, 4])
@pytest.mark.parametrize("recipe", ["q4_1", "q4_0", "q8_0"])
def test_matmul_nbits_graph_computes_the_blocks(tmp_path, recipe, accuracy_level):
    """The rewritten graph, run by ONNX Runtime, gives x @ (the recipe's dequantized weights).
    Float32 activations (accuracy_level 0): to float32 rounding. int8 activations (4, the
    default): within 2% of the output's scale, the rounding of x to int8 per block of 32
    (x's largest |value| / 127 per block, summed over K; measured ~0.5%)."""
    k, n = 128, 40
    w = weights(k, n, seed=2)
    path = tmp_path / "m.onnx"
    onnx.save(matmul_model(k, n, w, head=False), str(path))
    quantize_weight_only(path, "int4", WeightOnly(body=recipe, accuracy_level=accuracy_level, kernel="nbits"))
    model = onnx.load(str(path))
    ops = [x.op_type for x in model.graph.node]
    assert ops.count("MatMulNBits") == 1 and "w" not in {t.name for t in model.graph.initializer}
    deq = {"q4_1": lambda: blocks.dequantize_q4_1(*blocks.q4_1(w)), "q4_0": lambda: blocks.dequantize_q4_0(*blocks.q4_0(w)),
           "q8_0": lambda: blocks.dequantize_q8_0(*blocks.q8_0(w))}[recipe]()
    x = np.random.default_rng(3).standard_normal((2, 5, k)).astype(np.float32)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    want = np.maximum(x @ deq, 0)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= (1e-5 if accuracy_level == 0 else 2e-2), err


@pytest.mark.skipif(blocks_op.library() is None, reason="the block kernels were not built (no C compiler)")
@pytest.mark.parametrize("recipe", ["q4_1", "q4_0", "q8_0"])
def test_matmul_blocks_graph_computes_the_blocks(tmp_path, recipe):
    """The default kernel: one MatMulBlocks node over GGUF's own blocks (float16 scales, Q4_1's
    minimum in the block: no residual), run by ONNX Runtime with specdec's library, gives x @ the
    blocks' weights within 2% of the output's scale (x rounded to int8 per block of 32, as above)."""
    k, n = 128, 40
    w = weights(k, n, seed=2)
    path = tmp_path / "m.onnx"
    onnx.save(matmul_model(k, n, w, head=False), str(path))
    quantize_weight_only(path, "int4", WeightOnly(body=recipe))
    model = onnx.load(str(path))
    ops = [x.op_type for x in model.graph.node]
    assert ops == ["MatMulBlocks", "Relu"] and "w" not in {t.name for t in model.graph.initializer}
    deq = blocks.dequantize_column_blocks(blocks.column_blocks(w, recipe), recipe, k, n=n)
    x = np.random.default_rng(3).standard_normal((2, 5, k)).astype(np.float32)
    options = ort.SessionOptions()
    assert blocks_op.register(options)
    got = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    want = np.maximum(x @ deq, 0)
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()


def gated_mlp_model(k: int, n: int, w: np.ndarray, expose_gate: bool) -> onnx.ModelProto:
    """x [B, S, K] @ w [K, 2N] -> Split -> silu(gate) * up, as the exporter writes a Llama MLP;
    ``expose_gate``: the gate is a graph output too (then nothing may be folded)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"), helper.make_node("Split", ["y", "sizes"], ["g", "u"], axis=-1),
             helper.make_node("Sigmoid", ["g"], ["s"]), helper.make_node("Mul", ["g", "s"], ["silu"]), helper.make_node("Mul", ["u", "silu"], ["z"])]  # fmt: skip
    outs = [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["b", "s", n])]
    outs += [helper.make_tensor_value_info("g", TensorProto.FLOAT, ["b", "s", n])] if expose_gate else []
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array([n, n], np.int64), "sizes")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", k])], outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.skipif(blocks_op.library() is None, reason="the block kernels were not built (no C compiler)")
@pytest.mark.parametrize("recipe", ["q4_1", "q8_0"])
def test_a_gated_mlp_folds_into_its_product(tmp_path, recipe):
    """export/gated.py: Split, Sigmoid and the two Muls fold into one gated MatMulBlocks, which
    ONNX Runtime runs to the unfolded graph's values on the same blocks (the exp polynomial's
    few ulps: 1e-5 of the output's scale); with the gate also a graph output nothing is folded."""
    k, n = 64, 32
    w = weights(k, 2 * n, seed=5)
    x = np.random.default_rng(6).standard_normal((2, 3, k)).astype(np.float32)
    options = ort.SessionOptions()
    assert blocks_op.register(options)
    outs = {}
    for expose in (False, True):
        path = tmp_path / f"m{expose}.onnx"
        onnx.save(gated_mlp_model(k, n, w, expose), str(path))
        quantize_weight_only(path, "int4", WeightOnly(body=recipe))
        nodes = onnx.load(str(path)).graph.node
        gated = [a.i for node in nodes if node.op_type == "MatMulBlocks" for a in node.attribute if a.name == "gated"]
        assert ([node.op_type for node in nodes], gated) == ((["MatMulBlocks"], [1]) if not expose else (["MatMulBlocks", "Split", "Sigmoid", "Mul", "Mul"], []))
        outs[expose] = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(["z"], {"x": x})[0]
    np.testing.assert_allclose(outs[False], outs[True], rtol=0, atol=1e-5 * np.abs(outs[True]).max())


def test_head_is_found_and_kept_at_8_bits(tmp_path):
    """The MatMul that makes ``logits`` is the head: int4 stores it as q8_0 (as llama.cpp's Q4_1
    files keep the output matrix at Q8_0); the others as q4_1."""
    k, n = 64, 96
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="body"), helper.make_node("MatMul", ["h", "w2"], ["logits"], name="head")]
    inits = [numpy_helper.from_array(weights(k, k, 4), "w1"), numpy_helper.from_array(weights(k, n, 5), "w2")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", k])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", n])], inits)  # fmt: skip
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    assert head_matmuls(model) == ["head"]
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    quantize_weight_only(path, "int4")
    formats = {x.name: helper.get_attribute_value(next(a for a in x.attribute if a.name == "format"))
               for x in onnx.load(str(path)).graph.node if x.op_type == "MatMulBlocks"}  # fmt: skip
    assert formats == {"body_q4_1": blocks_op.FORMATS["q4_1"], "head_q8_0": blocks_op.FORMATS["q8_0"]}
    assert PRECISIONS["int4"].head == "q8_0"


def test_a_weight_shared_by_two_matmuls_is_stored_once(tmp_path):
    k, n = 64, 32
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"], name="m1"), helper.make_node("MatMul", ["x2", "w"], ["b"], name="m2"),
             helper.make_node("Add", ["a", "b"], ["y"], name="add")]  # fmt: skip
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(v, TensorProto.FLOAT, ["s", k]) for v in ("x", "x2")],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["s", n])], [numpy_helper.from_array(weights(k, n, 7), "w")])  # fmt: skip
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    quantize_weight_only(path, "int4", WeightOnly(body="q4_1", kernel="nbits"))  # two MatMulNBits and their residuals share it too
    names = [t.name for t in onnx.load(str(path)).graph.initializer]
    assert len(names) == len(set(names)) and sum(x.endswith("_q4") for x in names) == 1
    x = np.random.default_rng(8).standard_normal((3, k)).astype(np.float32)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x, "x2": x})[0]
    want = 2 * x @ blocks.dequantize_q4_1(*blocks.q4_1(weights(k, n, 7)))
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()

"""specdec's MatMulBlocks kernels (engines/csrc/): the product against a NumPy reference per format,
row invariance (a row's bits alone = among up to 16 rows), the same bits on every instruction set
and thread count, and the op inside ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from specdec.engines import blocks_op
from specdec.export.blocks import gguf_blocks

pytestmark = pytest.mark.skipif(blocks_op.library() is None, reason="the block kernels were not built (no C compiler)")

FORMATS = ("q8_0", "q4_0", "q4_1")
SHAPES = [(32, 1), (96, 5), (576, 37), (160, 130)]  # (K, N): one block, odd N, SmolLM2's width, N past two 64-column chunks


def weights(k: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(np.float32) * 0.05  # [K, N]
    w[rng.random((k, n)) < 0.01] *= 20  # outliers: blocks whose scale one weight sets
    return w


def activations(m: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed + 1)
    a = rng.standard_normal((m, k)).astype(np.float32)  # [M, K]
    a[:, : min(k, 32)] *= 30  # one block much larger than the rest, as residual streams have
    if m > 2:
        a[2] = 0.0  # an all-zero row: scale 0 must give 0, not NaN
    return a


def reference(a: np.ndarray, blob: np.ndarray, fmt: str, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(y, bound) in float64: the activations quantized per block of 32 as the kernel does
    (d = max|a| / 127, q = rint(a / d)), the products of integer codes exact, the rest in float64.
    ``bound`` is a forward-error bound for the kernel's float32 sequence (blocks.c): a scale
    product, up to K/32 + 4 additions per lane and the final ones each round once, so
    |y32 - y| <= (K/32 + 10) * 2^-24 * the sum of the absolute terms, Q4_1's scale and minimum
    terms counted apart (they may cancel; the kernel adds them apart)."""
    m, nb = a.shape[0], k // 32
    blocks = a.reshape(m, nb, 32)
    d = np.abs(blocks).max(-1) / np.float32(127)  # [M, nb] float32, as the kernel computes it
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.rint(blocks * inv[..., None])  # [M, nb, 32]
    b = blob.reshape(blob.shape[0], nb, -1)  # [N, nb, bytes]
    dw = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)  # [N, nb]
    if fmt == "q8_0":
        codes, mw = b[..., 2:].view(np.int8).astype(np.float64), np.zeros_like(dw)
    else:
        qs = b[..., 4:] if fmt == "q4_1" else b[..., 2:]
        codes = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float64) - (8 if fmt == "q4_0" else 0)  # [N, nb, 32]
        mw = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64) if fmt == "q4_1" else np.zeros_like(dw)
    da = d.astype(np.float64)
    scaled = np.einsum("mbi,nbi->mnb", q, codes) * dw[None] * da[:, None]  # [M, N, nb]
    minimum = mw[None] * (q.sum(-1) * da)[:, None]  # [M, N, nb]
    y = (scaled + minimum).sum(-1)
    size = np.einsum("mbi,nbi->mnb", np.abs(q), np.abs(codes)) * np.abs(dw)[None] * da[:, None] + np.abs(minimum)
    return y, (nb + 10) * 2.0**-24 * size.sum(-1)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k,n", SHAPES)
def test_matches_the_reference_on_every_isa(fmt, k, n):
    blob = gguf_blocks(weights(k, n, k + n), fmt)
    a = activations(16, k, k)
    ref, bound = reference(a, blob, fmt, k)
    assert blocks_op.isas()[0] == "portable" and blocks_op.isa() in blocks_op.isas()
    outs = {name: blocks_op.matmul(a, blob, n, fmt, name) for name in blocks_op.isas()}
    for name, y in outs.items():
        err = np.abs(y - ref)
        assert (err <= bound).all(), f"{name}: {err.max():.3g} past the bound at {np.unravel_index((err - bound).argmax(), err.shape)}"
        assert not y[2].any(), "an all-zero row gives zeros"
        np.testing.assert_array_equal(y, outs["portable"], err_msg=f"{name} and portable differ: the float sequence is not the same")


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_has_the_same_bits_whatever_shares_the_call(fmt):
    k, n = 576, 37
    blob = gguf_blocks(weights(k, n, 3), fmt)
    a = activations(16, k, 5)
    for name in blocks_op.isas():
        alone = np.concatenate([blocks_op.matmul(a[i : i + 1], blob, n, fmt, name) for i in range(16)])
        for m in range(1, 17):
            np.testing.assert_array_equal(blocks_op.matmul(a[:m], blob, n, fmt, name), alone[:m], err_msg=f"{name}, {m} rows")
        shuffled = np.random.default_rng(0).permutation(16)
        np.testing.assert_array_equal(blocks_op.matmul(a[shuffled], blob, n, fmt, name), alone[shuffled])


def test_bad_shapes_are_refused_by_name():
    with pytest.raises(ValueError, match="K must be a multiple of 32"):
        blocks_op.matmul(np.zeros((1, 40), np.float32), np.zeros((2, 40), np.uint8), 2, "q8_0")


def op_model(k: int, n: int, fmt: str, blob: np.ndarray) -> bytes:
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", "seq", k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", n])
    node = helper.make_node(blocks_op.OP, ["a", "w"], ["y"], domain=blocks_op.DOMAIN, K=k, N=n, format=blocks_op.FORMATS[fmt])
    graph = helper.make_graph([node], "blocks", [a], [y], [numpy_helper.from_array(blob, "w")])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(blocks_op.DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def session(model: bytes, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    assert blocks_op.register(options)
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_op_in_onnx_runtime_is_the_kernel_on_any_threads(fmt):
    k, n = 576, 200  # four column chunks: the op splits them over ONNX Runtime's threads
    blob = gguf_blocks(weights(k, n, 11), fmt)
    a = activations(2 * 8, k, 13).reshape(2, 8, k)  # [batch, seq, K]: rows are batch x seq
    model = op_model(k, n, fmt, blob)
    one, two = session(model, 1), session(model, 2)
    y = one.run(None, {"a": a})[0]
    np.testing.assert_array_equal(y.reshape(16, n), blocks_op.matmul(a.reshape(16, k), blob, n, fmt))
    np.testing.assert_array_equal(two.run(None, {"a": a})[0], y)
    for s in range(1, 9):  # a verify call of s rows against the rows of the full call
        np.testing.assert_array_equal(two.run(None, {"a": a[:1, :s]})[0], y[:1, :s])
    assert two.run(None, {"a": np.zeros((1, 0, k), np.float32)})[0].shape == (1, 0, n)

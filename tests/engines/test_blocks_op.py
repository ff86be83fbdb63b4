"""specdec's MatMulBlocks kernels (engines/csrc/): the product against a NumPy reference per format,
row invariance (a row's bits alone = among up to 16 rows), the same bits on every instruction set
and thread count, and the op inside ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from specdec.engines import blocks_op
from specdec.export import blocks
from specdec.export.blocks import column_blocks, unpack_column_blocks

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


def reference(a: np.ndarray, blob: np.ndarray, fmt: str, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
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
    codes, dw, mw = unpack_column_blocks(blob, fmt, k, n=n)  # [N, nb, 32] signed, [N, nb] x 2
    codes, dw, mw = codes.astype(np.float64), dw.astype(np.float64), mw.astype(np.float64)
    da = d.astype(np.float64)
    scaled = np.einsum("mbi,nbi->mnb", q, codes) * dw[None] * da[:, None]  # [M, N, nb]
    minimum = mw[None] * (q.sum(-1) * da)[:, None]  # [M, N, nb]
    y = (scaled + minimum).sum(-1)
    size = np.einsum("mbi,nbi->mnb", np.abs(q), np.abs(codes)) * np.abs(dw)[None] * da[:, None] + np.abs(minimum)
    return y, (nb + 10) * 2.0**-24 * size.sum(-1)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k,n", SHAPES)
def test_matches_the_reference_on_every_isa(fmt, k, n):
    blob = column_blocks(weights(k, n, k + n), fmt)
    a = activations(16, k, k)
    ref, bound = reference(a, blob, fmt, k, n)
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
    blob = column_blocks(weights(k, n, 3), fmt)
    a = activations(16, k, 5)
    for name in blocks_op.isas():
        alone = np.concatenate([blocks_op.matmul(a[i : i + 1], blob, n, fmt, name) for i in range(16)])
        for m in range(1, 17):
            np.testing.assert_array_equal(blocks_op.matmul(a[:m], blob, n, fmt, name), alone[:m], err_msg=f"{name}, {m} rows")
        shuffled = np.random.default_rng(0).permutation(16)
        np.testing.assert_array_equal(blocks_op.matmul(a[shuffled], blob, n, fmt, name), alone[shuffled])


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_gated_product_is_silu_of_the_gate_times_the_up_projection(fmt):
    """``gated``: the gate's and the up projection's panels in turn, one output panel from each
    pair: silu(a @ gate) * (a @ up) against NumPy in float64 on the kernel's own halves, within 8
    float32 ulps (rtol 3.2e-6) or 4e-7 of the largest result (the exp polynomial's ~2 ulps, then
    a division and two products rounding once each); every instruction set gives the same bits,
    and a row's bits do not depend on the other rows."""
    k, n = 160, 48
    gate, up = weights(k, n, 1), weights(k, n, 2)
    blob = blocks.gated_blocks(column_blocks(np.concatenate([gate, up], axis=1), fmt))
    assert np.array_equal(blocks.ungated_blocks(blob), column_blocks(np.concatenate([gate, up], axis=1), fmt))
    a = activations(12, k, 4)
    g = blocks_op.matmul(a, column_blocks(gate, fmt), n, fmt).astype(np.float64)
    u = blocks_op.matmul(a, column_blocks(up, fmt), n, fmt).astype(np.float64)
    ref = g / (1 + np.exp(-g)) * u
    outs = {name: blocks_op.matmul(a, blob, n, fmt, name, gated=True) for name in blocks_op.isas()}
    for name, y in outs.items():
        np.testing.assert_allclose(y, ref, rtol=4e-7 * 8, atol=4e-7 * np.abs(ref).max(), err_msg=name)
        np.testing.assert_array_equal(y, outs["portable"], err_msg=f"{name} and portable differ")
        alone = np.concatenate([blocks_op.matmul(a[i : i + 1], blob, n, fmt, name, gated=True) for i in range(len(a))])
        np.testing.assert_array_equal(y, alone, err_msg=f"{name}: a row's bits depend on the call")


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
    blob = column_blocks(weights(k, n, 11), fmt)
    a = activations(2 * 8, k, 13).reshape(2, 8, k)  # [batch, seq, K]: rows are batch x seq
    model = op_model(k, n, fmt, blob)
    one, two = session(model, 1), session(model, 2)
    y = one.run(None, {"a": a})[0]
    np.testing.assert_array_equal(y.reshape(16, n), blocks_op.matmul(a.reshape(16, k), blob, n, fmt))
    np.testing.assert_array_equal(two.run(None, {"a": a})[0], y)
    for s in range(1, 9):  # a verify call of s rows against the rows of the full call
        np.testing.assert_array_equal(two.run(None, {"a": a[:1, :s]})[0], y[:1, :s])
    assert two.run(None, {"a": np.zeros((1, 0, k), np.float32)})[0].shape == (1, 0, n)


# -- attention ------------------------------------------------------------------------------------

H, KV, D, T = 4, 2, 16, 24  # heads, kv heads, head size, buffer rows


def attention_model(domain: str, window: int, softcap: float, interleaved: int) -> bytes:
    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    ins = [helper.make_tensor_value_info("qkv", f, [1, "s", (H + 2 * KV) * D]),
           helper.make_tensor_value_info("past_key", f, [1, KV, T, D]), helper.make_tensor_value_info("past_value", f, [1, KV, T, D]),
           helper.make_tensor_value_info("seqlens_k", i32, [1]), helper.make_tensor_value_info("total", i32, []),
           helper.make_tensor_value_info("cos", f, [T, D // 2]), helper.make_tensor_value_info("sin", f, [T, D // 2])]  # fmt: skip
    outs = [helper.make_tensor_value_info("out", f, [1, "s", H * D]),
            helper.make_tensor_value_info("present_key", f, [1, KV, T, D]), helper.make_tensor_value_info("present_value", f, [1, KV, T, D])]  # fmt: skip
    attrs = dict(num_heads=H, kv_num_heads=KV, scale=0.3, local_window_size=window, do_rotary=1, rotary_interleaved=interleaved)
    if softcap:
        attrs["softcap"] = softcap
    node = helper.make_node("GroupQueryAttention", ["qkv", "", "", "past_key", "past_value", "seqlens_k", "total", "cos", "sin"],
                            ["out", "present_key", "present_value"], domain=domain, **attrs)  # fmt: skip
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)]
    return helper.make_model(helper.make_graph([node], "attention", ins, outs), opset_imports=opsets).SerializeToString()


def attend(s: ort.InferenceSession, qkv: np.ndarray, past: tuple[np.ndarray, np.ndarray], start: int):
    """qkv's rows at positions start.. over the buffers ``past`` (rows [0, start) written)."""
    n = qkv.shape[1]
    angles = np.arange(T)[:, None] / (10000 ** (np.arange(D // 2) / (D // 2)))  # [T, D/2]
    feeds = {"qkv": qkv, "past_key": past[0], "past_value": past[1], "seqlens_k": np.array([start + n - 1], np.int32),
             "total": np.array(start + n, np.int32), "cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32)}  # fmt: skip
    out, key, value = s.run(None, feeds)
    return out, (key, value)


@pytest.mark.parametrize("window, softcap, interleaved", [(-1, 0.0, 0), (5, 0.0, 1), (-1, 4.0, 0)])
def test_attention_is_onnx_runtimes_and_row_invariant(window, softcap, interleaved):
    """ai.specdec's GroupQueryAttention against com.microsoft's on the same inputs (packed qkv,
    rotary, a window, soft-capping): the same values to 1e-5 of their scale (float32 reductions in
    another order); and a verify call of 5 rows gives each row the bits of 5 one-row calls."""
    rng = np.random.default_rng(2 + window + 7 * interleaved)
    ours, theirs = (session(attention_model(d, window, softcap, interleaved), 2) for d in (blocks_op.DOMAIN, "com.microsoft"))
    past = tuple(rng.standard_normal((1, KV, T, D)).astype(np.float32) for _ in range(2))  # rows [0, 9) are a prefix's
    qkv = rng.standard_normal((1, 5, (H + 2 * KV) * D)).astype(np.float32)
    got, (key, value) = attend(ours, qkv, tuple(p.copy() for p in past), 9)
    want, (wkey, wvalue) = attend(theirs, qkv, tuple(p.copy() for p in past), 9)
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)
    np.testing.assert_allclose(key[:, :, :14], wkey[:, :, :14], atol=1e-5, rtol=0)  # the prefix kept, the new rows rotated alike
    np.testing.assert_array_equal(value[:, :, :14], wvalue[:, :, :14])
    one = tuple(p.copy() for p in past)
    rows = []
    for i in range(5):
        out, one = attend(ours, qkv[:, i : i + 1], one, 9 + i)
        rows.append(out)
    np.testing.assert_array_equal(np.concatenate(rows, axis=1), got)
    np.testing.assert_array_equal(one[0][:, :, :14], key[:, :, :14])

"""ONNX Runtime's CPU GroupQueryAttention verifies a tree in one call: its causal mask over the
new rows, plus an additive ``attention_bias`` hiding every node that is not an ancestor, gives
each node attention over the past and its own root-to-node path only (issue 28's tree verify
graph is built on this; the T5 export already feeds the same input its relative bias)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

H, KVH, D, MAX = 4, 2, 8, 32
HIDDEN = -1e30  # a large finite bias for hidden nodes (-inf gives the same result on this kernel)


def _session() -> ort.InferenceSession:
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "seqlens", "total", "", "", "", "bias"],
                            ["out", "present_k", "present_v"], domain="com.microsoft", num_heads=H, kv_num_heads=KVH)  # fmt: skip
    f = TensorProto.FLOAT
    graph = helper.make_graph([node], "tree", [
        helper.make_tensor_value_info("q", f, [1, "S", H * D]), helper.make_tensor_value_info("k", f, [1, "S", KVH * D]),
        helper.make_tensor_value_info("v", f, [1, "S", KVH * D]), helper.make_tensor_value_info("pk", f, [1, KVH, MAX, D]),
        helper.make_tensor_value_info("pv", f, [1, KVH, MAX, D]), helper.make_tensor_value_info("seqlens", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("total", TensorProto.INT32, []), helper.make_tensor_value_info("bias", f, [1, 1, "S", "T"])],
        [helper.make_tensor_value_info(n, f, None) for n in ("out", "present_k", "present_v")])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_a_tree_mask_through_attention_bias():
    rng = np.random.default_rng(0)
    past = 5
    parents = [-1, 0, 0, 1, -1, 4]  # two branches under the root; nodes 1 and 2 are siblings
    s = len(parents)
    total = past + s
    ancestor = np.zeros((s, s), dtype=bool)  # [S, S]: node i sees node j
    for i in range(s):
        j = i
        while j >= 0:
            ancestor[i, j], j = True, parents[j]
    visible = np.concatenate([np.ones((s, past), dtype=bool), ancestor], axis=1)  # [S, T]
    q = rng.standard_normal((1, s, H * D)).astype(np.float32)
    k_all = rng.standard_normal((1, KVH, total, D)).astype(np.float32)
    v_all = rng.standard_normal((1, KVH, total, D)).astype(np.float32)
    pk, pv = np.zeros((1, KVH, MAX, D), np.float32), np.zeros((1, KVH, MAX, D), np.float32)
    pk[:, :, :past], pv[:, :, :past] = k_all[:, :, :past], v_all[:, :, :past]
    new = lambda a: a[:, :, past:].transpose(0, 2, 1, 3).reshape(1, s, KVH * D)  # noqa: E731
    feeds = dict(q=q, k=new(k_all), v=new(v_all), pk=pk, pv=pv, seqlens=np.array([total - 1], np.int32),
                 total=np.array(total, np.int32), bias=np.where(visible, 0.0, HIDDEN).astype(np.float32)[None, None])  # fmt: skip
    out = _session().run(["out"], feeds)[0]

    qh = q.reshape(1, s, H, D).transpose(0, 2, 1, 3)  # [1, H, S, D]
    kh, vh = np.repeat(k_all, H // KVH, 1), np.repeat(v_all, H // KVH, 1)  # [1, H, T, D]
    scores = np.where(visible, qh @ kh.transpose(0, 1, 3, 2) / np.sqrt(D), -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    ref = ((w / w.sum(-1, keepdims=True)) @ vh).transpose(0, 2, 1, 3).reshape(1, s, H * D)
    np.testing.assert_allclose(out, ref, atol=1e-5)
    # without the bias, siblings would see each other: the check can tell the difference
    feeds["bias"] = np.zeros_like(feeds["bias"])
    assert np.abs(_session().run(["out"], feeds)[0] - ref).max() > 1e-2

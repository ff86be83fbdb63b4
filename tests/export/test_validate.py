"""Export validation still refuses broken graphs once float32 is bounded relative to the logits.

One tiny llama bundle (the session's ``llama_bundle``) is validated against PyTorch references
that differ from the exported model as a broken graph would: another RoPE base, two KV heads
swapped, one layer fewer in the graph. Each must raise ValidationError naming the check; the
true reference must pass.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from specdec.errors import ValidationError  # noqa: E402
from specdec.export.validate import TOLERANCES, Agreement, check, validate_model  # noqa: E402
from specdec.manifest import load_manifest  # noqa: E402

FP32 = {"target": TOLERANCES[("float32", None)]}


def reference(folder, theta: float | None = None):
    """The checkpoint in PyTorch (eager attention), its rotary base changed to ``theta`` if given."""
    from models import set_rope
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(folder)
    if theta is not None:
        set_rope(cfg, theta)
    return AutoModelForCausalLM.from_pretrained(folder, config=cfg, attn_implementation="eager").eval()


def figures(bundle, model) -> dict:
    m = load_manifest(bundle)
    t = m.target
    kv = (t.num_layers, t.num_kv_heads, m.max_seq_len, t.head_dim, m.dtype)
    return {"target": validate_model(model, bundle, m.graph("target", "dynamic"), m.graph("target", "verify"), kv)}


def swapped_kv_heads(model):
    """Layer 0's KV heads 0 and 1 exchanged, in both k and v (a layout bug)."""
    model = copy.deepcopy(model)
    attn = model.model.layers[0].self_attn
    d = attn.head_dim
    with torch.no_grad():
        for proj in (attn.k_proj, attn.v_proj):
            w = proj.weight
            w[: 2 * d] = torch.cat([w[d : 2 * d], w[:d]]).clone()
    return model


def one_more_layer(model):
    """The reference has a layer the graph lacks: the graph misses one."""
    model = copy.deepcopy(model)
    extra = copy.deepcopy(model.model.layers[-1])
    extra.self_attn.layer_idx = len(model.model.layers)
    model.model.layers.append(extra)
    model.config.num_hidden_layers += 1
    return model


def test_true_reference_passes(llama_bundle):
    target, _, out = llama_bundle
    f = figures(out, reference(target))
    check(f, FP32)
    assert f["target"]["top1_agreement"] == 1.0 and f["target"]["logits_scale"] > 1 and f["target"]["kv_scale"] > 0
    # Greedy over several steps on several prompts: every step compared agrees.
    assert f["target"]["greedy_steps"] >= 30 and f["target"]["greedy_mismatches"] == 0


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param(lambda t: reference(t, theta=500.0), id="rope-base"),
        pytest.param(lambda t: swapped_kv_heads(reference(t)), id="swapped-kv-heads"),
        pytest.param(lambda t: one_more_layer(reference(t)), id="missing-layer"),
    ],
)
def test_broken_graph_is_refused(llama_bundle, broken):
    target, _, out = llama_bundle
    with pytest.raises(ValidationError) as err:
        check(figures(out, broken(target)), FP32)
    msg = str(err.value)
    assert "target logits: max|Δ|" in msg and "x max(1, max|logit|" in msg and "\n" not in msg, msg
    assert "target top-1: agreement" in msg, msg  # random tokens: the argmax moves too
    assert "target greedy:" in msg and "rollouts chose another token" in msg, msg  # and greedy decoding parts from PyTorch's


def test_near_ties_do_not_count():
    """A flipped top-1 where the reference's top-2 gap is below NEAR_TIE x scale is not a failure;
    elsewhere it is, and the message says by how much and against which bound."""
    ref = np.array([[5.0, 5.0002, 0.0], [5.0, 3.0, 0.0]], dtype=np.float32)
    tie = Agreement()
    tie.logits(np.array([[5.0002, 5.0, 0.0], [5.0, 3.0, 0.0]], dtype=np.float32), ref)
    f = tie.figures()
    assert (f["top1_agreement"], f["near_ties"], f["positions"]) == (1.0, 1, 2)
    check({"target": {**f, "present_key": None, "present_value": None}}, FP32)
    flip = Agreement()
    flip.logits(np.array([[5.0, 5.0002, 0.0], [3.0, 5.0, 0.0]], dtype=np.float32), ref)
    with pytest.raises(ValidationError, match=r"target top-1: agreement 0\.000 < 1 \(1 of 1 positions differ, reference top-2 gap up to 2"):
        check({"target": {**flip.figures(), "present_key": None, "present_value": None}}, FP32)


def test_logits_bound_follows_the_scale():
    """The same |Δ| passes on logits of scale 30 and fails on logits of scale 1."""
    ref = np.zeros((1, 4), dtype=np.float32)
    ref[0, 0] = 30.0
    big = Agreement()
    big.logits(ref + 2e-3 * np.array([[0, 1, 0, 0]], dtype=np.float32), ref)
    check({"target": {**big.figures(), "present_key": None, "present_value": None}}, FP32)
    small = Agreement()
    small.logits(ref / 30 + 2e-3 * np.array([[0, 1, 0, 0]], dtype=np.float32), ref / 30)
    with pytest.raises(ValidationError, match=r"target logits: max\|Δ\| 0\.002 > 0\.0001"):
        check({"target": {**small.figures(), "present_key": None, "present_value": None}}, FP32)


def test_max_kl_decides_for_a_changed_target_and_top1_then_only_catches_broken_graphs():
    from specdec.export.validate import BROKEN_TOP1, tolerance

    default = tolerance("float32", "int4", "target")
    assert (default.min_top1, default.max_text_kl) == (0.5, 0.05)
    given = tolerance("float32", "int4", "target", max_kl=float("inf"))
    assert (given.min_top1, given.max_text_kl) == (BROKEN_TOP1, float("inf"))
    weak = {"target": {"logits": 3.0, "logits_scale": 9.0, "top1_agreement": 0.19, "positions": 47, "near_ties": 0,
                       "text_kl": 0.056, "text_top1": 0.5, "text_positions": 111, "present_key": None, "present_value": None}}
    with pytest.raises(ValidationError, match="top-1: agreement 0.190 < 0.5"):
        check(weak, {"target": default})
    check(weak, {"target": given})  # random weights at size: near-uniform logits flip, the KL is the user's call
    broken = {"target": {**weak["target"], "top1_agreement": 0.001}}
    with pytest.raises(ValidationError, match="top-1: agreement 0.001 < 0.05"):
        check(broken, {"target": given})
    assert tolerance("float32", None, "target", max_kl=0.01) == TOLERANCES[("float32", None)]  # float32 is held exactly
    assert tolerance("float32", "int4", "draft").max_text_kl == float("inf")

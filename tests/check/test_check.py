"""``specdec check``: every test bundle passes it, and each deliberately broken one is caught with
a one-line reason naming what broke."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import config_for, make_tokenizer, near_copy, peaked_model, rope_theta, set_rope  # noqa: E402
from test_cli import SPECDEC  # noqa: E402

from specdec.commands import check  # noqa: E402
from specdec.commands.check import exactness  # noqa: E402
from specdec.commands.check.items import Loaded  # noqa: E402
from specdec.errors import BundleError  # noqa: E402
from specdec.manifest import load_manifest  # noqa: E402


def specdec(*args: str) -> subprocess.CompletedProcess:
    cmd = [SPECDEC, *args] if SPECDEC else [sys.executable, "-m", "specdec", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def by_name(items) -> dict:
    return {i.name: i for i in items}


def test_every_family_passes_the_quick_check(family_bundle):
    family, _, _, out, _ = family_bundle
    items = check.run(out, quick=True)
    assert check.passed(items), check.report(out, items, 0)
    names = by_name(items)
    assert {"integrity", "exactness", "speed"} == {i.section for i in items}
    assert {"files", "graphs", "versions", "draft pairing", "advice", "verify cost"} <= set(names)
    drafters = exactness.carried(load_manifest(out))
    assert all(f"greedy, {d}" in names for d in drafters) and f"sampled, {drafters[0]}" in names
    assert names[f"sampled, {drafters[0]}"].ok is True, names[f"sampled, {drafters[0]}"]  # both paths exercised on the near draft
    assert names["draft pairing"].ok is True


@pytest.mark.parametrize("family_bundle", ["llama"], indirect=True)
def test_the_check_on_another_provider_compares_its_tokens_with_the_cpu(family_bundle, monkeypatch):
    """``specdec check --provider cuda`` runs every section there and adds the device's
    autoregressive tokens against the CPU's; here a provider standing for CUDA (the CPU provider
    with the KV in OrtValues, the device code path). Without CUDA the CLI refuses in one line."""
    import onnxruntime as ort

    from specdec.engines import sessions as ort_sessions

    out = family_bundle[3]
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        run = specdec("check", str(out), "--quick", "--provider", "cuda")
        assert run.returncode == 2 and "onnxruntime lacks" in run.stderr and run.stderr.count("\n") == 1, run.stderr
    monkeypatch.setitem(ort_sessions.PROVIDERS, "device", ort_sessions.PROVIDERS["cpu"])
    monkeypatch.setitem(ort_sessions.DEVICE, "device", "ortvalue")
    items = check.run(out, quick=True, provider="device")
    assert check.passed(items), check.report(out, items, 0)
    names = by_name(items)
    assert names["greedy on device against the CPU (autoregressive)"].ok is True
    assert isinstance(Loaded.of(out, load_manifest(out), ["model"], None, "device").base.engine.target.slot(0).keys[0], ort.OrtValue)


def test_the_full_check_of_a_chat_bundle_with_batched_graphs(chat_bundle):
    """Built-in chat requests through the template; every drafter sampled and in a BatchEngine."""
    _, out = chat_bundle
    items = check.run(out)
    assert check.passed(items), check.report(out, items, 0)
    m = load_manifest(out)
    names = by_name(items)
    for d in exactness.carried(m):
        assert names[f"sampled, {d}"].ok in (True, None) and f"greedy, {d}, BatchEngine ({m.max_batch} rows)" in names
    assert any(n.startswith("prediction") for n in names) and "4 rows" in names["advice"].detail
    assert "serve with --threads" in names["threads"].detail and "1: " in names["threads"].detail  # one thread against one per core


def test_encoder_decoder_bundles_get_the_greedy_check(seq2seq_bundle):
    family, _, _, out, _ = seq2seq_bundle
    items = check.run(out, quick=True)
    assert check.passed(items), check.report(out, items, 0)
    names = by_name(items)
    assert names["greedy, model"].ok is True and names["sampled"].ok is None and names["speed"].ok is None


def test_the_cli_reports_json_and_a_flipped_byte_fails_it(llama_bundle, tmp_path):
    _, _, bundle = llama_bundle
    run = specdec("check", str(bundle), "--quick", "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["passed"] and {i["section"] for i in report["items"]} == {"integrity", "exactness", "speed"}

    broken = tmp_path / "bundle"
    shutil.copytree(bundle, broken)
    weights = broken / "target.weights"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    run = specdec("check", str(broken), "--quick")
    assert run.returncode == 1, run.stdout + run.stderr
    failed = [line for line in run.stdout.splitlines() if line.startswith("| ✗")]
    assert len(failed) == 1 and "files" in failed[0] and "target.weights" in failed[0], run.stdout
    assert "## exactness" not in run.stdout  # other bytes than the manifest's: nothing else is run on them
    run = specdec("serve", str(broken), "--check")  # refused before anything binds a port
    assert run.returncode == 2 and run.stderr.strip().count("\n") == 0, run.stderr
    assert "failed specdec check --quick (integrity, files)" in run.stderr and "target.weights" in run.stderr

    run = specdec("check", str(tmp_path / "nothing"))
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "not a bundle" in run.stderr, run.stderr


def test_a_graph_that_is_not_the_manifests_is_named(llama_bundle, tmp_path):
    """The manifest (not hashed itself) says a graph input is float16: the graphs check names the graph and tensor."""
    _, _, bundle = llama_bundle
    broken = tmp_path / "bundle"
    shutil.copytree(bundle, broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    spec = manifest["graphs"]["target_verify"]
    past = next(t for t in spec["inputs"] if t["name"].startswith("past_key"))
    past["dtype"] = "float16"
    (broken / "manifest.json").write_text(json.dumps(manifest))
    items = by_name(check.run(broken, quick=True))
    assert items["graphs"].ok is False
    assert "target_verify" in items["graphs"].detail and past["name"] in items["graphs"].detail and "float16" in items["graphs"].detail


@pytest.mark.parametrize("family_bundle", ["llama"], indirect=True)  # its near draft is accepted about half the time
def test_a_sampler_that_forgets_the_residual_is_caught(family_bundle, monkeypatch):
    """The subtlest sampling bug: at a rejection, drawing from p instead of norm(max(0, p − q))
    (greedy stays exact, so only the law can show it)."""
    from specdec.runtime import speculative

    bundle = family_bundle[3]
    m = load_manifest(bundle)
    prompts = check.prompts(bundle, m, 4)
    loaded = Loaded.of(bundle, m, ["model"], None)
    monkeypatch.setattr(speculative, "_residual", lambda p, q: p.copy())
    [item] = exactness.sampled(m, loaded, prompts, 1000, ["model"])
    assert item.ok is False and "differs from the target's" in item.detail, item
    monkeypatch.undo()
    [item] = exactness.sampled(m, loaded, prompts, 1000, ["model"])
    assert item.ok is True, item


@pytest.fixture(scope="module")
def miswired(tmp_path_factory):
    """A bundle exported with two faults: the target's rotary base is 100x its checkpoint's (its
    weights unchanged), and the draft's vocabulary is permuted (what a draft with another
    tokenizer looks like). Returns (the true target, the bundle)."""
    import numpy as np
    import torch

    from specdec.export.pipeline import ExportConfig, export_bundle

    root = tmp_path_factory.mktemp("miswired")
    target = peaked_model(config_for("llama"), 0)
    draft = near_copy(target, 0.1, 1)
    perm = torch.from_numpy(np.random.default_rng(0).permutation(target.config.vocab_size))
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(draft.model.embed_tokens.weight[perm])
        draft.lm_head.weight.copy_(draft.lm_head.weight[perm])
    target.save_pretrained(root / "target")
    set_rope(target.config, theta=rope_theta(target.config) * 100)
    target.save_pretrained(root / "wrong-rope")
    draft.save_pretrained(root / "draft")
    for name in ("target", "wrong-rope", "draft"):
        make_tokenizer(root / name)
    export_bundle(ExportConfig(str(root / "wrong-rope"), str(root / "draft"), root / "bundle", gamma=4, max_seq_len=128))
    return root / "target", root / "bundle"


def test_a_wrong_rope_base_and_a_foreign_draft_are_each_named(miswired):
    target, bundle = miswired
    items = check.run(bundle, quick=True, reference=str(target))
    names = by_name(items)
    failed = {i.name for i in items if i.ok is False}
    assert failed == {"reference greedy", "draft pairing"}, check.report(bundle, items, 0)
    assert "clear call" in names["reference greedy"].detail and "re-export" in names["reference greedy"].fix
    assert "chance level" in names["draft pairing"].detail and "0 of" in names["draft pairing"].detail
    assert names["greedy, model"].ok is True  # still exact: speculation keeps the (wrong) target's output
    # the same bundle against the checkpoint it was really exported from passes the reference checks
    items = by_name(check.run(bundle, quick=True, reference=str(target.parent / "wrong-rope")))
    assert items["reference greedy"].ok is True


def test_a_bundle_on_the_row_invariant_kernels_has_no_close_calls(llama_bundle):
    """int8/int4 on specdec's kernels (the manifest's custom_ops) are held to token-for-token
    equality, and the kernels item says what runs; on MatMulNBits a close call is still allowed."""
    import dataclasses

    import numpy as np

    m = load_manifest(llama_bundle[2])
    ops = {"domain": "ai.specdec", "ops": ["GroupQueryAttention", "MatMulBlocks"], "library": "x", "without": "x", "layout": 2}
    blocks, nbits = dataclasses.replace(m, quantization="int8", custom_ops=ops), dataclasses.replace(m, quantization="int8")
    with pytest.raises(BundleError, match="layout=None.*re-export"):  # the last stop's column-at-a-time bytes: refused, not misread
        dataclasses.replace(m, quantization="int8", custom_ops={k: v for k, v in ops.items() if k != "layout"})
    logits = np.array([3.0, 2.99, -1.0])
    assert exactness.close_call_gap(blocks, logits) == 0.0 and exactness.row_invariant(blocks)
    assert exactness.close_call_gap(nbits, logits) == pytest.approx(exactness.CLOSE_QUANTIZED * 3.0) and not exactness.row_invariant(nbits)
    assert exactness.kernels(blocks).ok is True and "MatMulBlocks" in exactness.kernels(blocks).detail
    assert exactness.kernels(nbits).ok is None and "close call" in exactness.kernels(nbits).detail
    assert exactness.kernels(m) is None  # float weights: nothing to say

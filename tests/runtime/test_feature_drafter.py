"""The feature drafter (EAGLE-style head, export/head.py + export/train_head.py), end to end on a tiny llama target.

``specdec train-drafter`` on a copy of the llama bundle: the target graphs gain their features,
the head graph reads the target's own embedding and LM head from the target's weight file, the
bundle is replaced only when all of it passed. Decoding with ``drafter="feature"`` keeps the
target's output: greedy token for token (one request, and several in one BatchEngine), sampled
in law (first two tokens, chi-square).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("scipy.stats")

from models import measured_default  # noqa: E402
from test_decoder_exact import PROMPTS, chi_square_p, exact_first_two, load_model, torch_greedy  # noqa: E402

from specdec.errors import ConfigError  # noqa: E402
from specdec.runtime import BatchEngine, SamplingConfig, SpeculativeDecoder  # noqa: E402

NEW = 60


def corpus_prompts(dec) -> list[list[int]]:
    """Openings in the training corpus's text, where the head has learned the target."""
    from models import CORPUS

    return [dec.codec.encode(CORPUS[a : a + 60], special=False) for a in (0, 130, 260)]


def digests(folder) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def feature_bundle(family_bundle, tmp_path_factory):
    """A copy of the llama bundle with a feature head trained for a few steps on a small corpus."""
    from models import train_tiny_head

    family, target, draft, out, manifest = family_bundle
    root = tmp_path_factory.mktemp("feature")
    bundle = root / "bundle"
    shutil.copytree(out, bundle)
    record = train_tiny_head(bundle, root, save=root / "head")
    return target, bundle, record, root


LLAMA = pytest.mark.parametrize("family_bundle", ["llama"], indirect=True)
# Greedy runs on the families whose graphs differ most (q/k norms, fused projections, sliding
# windows and soft-capping, partial rotary); the rest run on llama.
GREEDY_FAMILIES = pytest.mark.parametrize("family_bundle", ["llama", "qwen3", "phi3", "gemma3", "gemma2", "gpt_neox"], indirect=True)


@LLAMA
def test_train_drafter_adds_features_and_a_head_sharing_the_target_weights(feature_bundle):
    import onnx

    from specdec.engines.kv import KVCache
    from specdec.engines.ort import runner_for
    from specdec.export.feature import tables
    from specdec.manifest import load_manifest

    _, bundle, record, root = feature_bundle
    m = load_manifest(bundle, stamps=False)  # every file re-hashed
    assert m.head is not None and m.feature["width"] == m.target.hidden_size
    assert all(g.io.features for g in m.graphs.values() if g.model == "target" and g.role != "move"), "every target graph returns its features"
    head = m.graphs["head_dynamic"]
    locations = [e.value for t in onnx.load(str(bundle / head.file), load_external_data=False).graph.initializer for e in t.external_data if e.key == "location"]
    assert locations.count("target.weights") >= 2, "the head reads the target's embedding and LM head from the target's file"
    assert (bundle / "head.weights").stat().st_size < (bundle / "target.weights").stat().st_size
    assert record["held_out"]["after"]["alpha_t1"] > record["held_out"]["before"]["alpha_t1"], "training improved the held-out acceptance"
    assert (root / "head" / "head.safetensors").is_file()
    # The features are what the LM head reads: features @ H == logits (a llama head has no soft-cap).
    name, g = m.graph("target", "dynamic")
    t = m.target
    runner = runner_for(bundle, name, g, KVCache(t.num_layers, t.num_kv_heads, m.max_seq_len, t.head_dim, m.dtype))
    logits = runner.run(np.array(PROMPTS[2])).copy()
    _, head_t, _ = tables(bundle, m)
    np.testing.assert_allclose(runner.features[0, : len(PROMPTS[2])] @ head_t, logits, rtol=0, atol=1e-4)


@GREEDY_FAMILIES
def test_feature_drafter_greedy_is_the_target_token_for_token(feature_bundle):
    target, bundle, _, _ = feature_bundle
    model = load_model(target)
    dec = SpeculativeDecoder.load(bundle, drafter="feature")
    accepted = rejected = 0
    for prompt in [*PROMPTS, *corpus_prompts(dec)]:
        ref = torch_greedy(model, prompt, NEW)
        for gamma in (1, 2, 4):
            res = dec.generate(prompt, max_new_tokens=NEW, gamma=gamma, ignore_eos=True)
            assert res.tokens == ref, f"gamma={gamma} prompt={prompt}"
            accepted += res.stats.accepted
            rejected += res.stats.verify_calls - res.stats.accepted_at[gamma - 1]
    assert accepted >= 20 and rejected >= 20, f"accepted {accepted} drafts, {rejected} rejecting calls: both paths must be crossed"


@LLAMA
def test_feature_drafter_in_a_batch_keeps_each_row_exact(feature_bundle):
    target, bundle, _, _ = feature_bundle
    model = load_model(target)
    prompts = [PROMPTS[0], *corpus_prompts(SpeculativeDecoder.load(bundle, drafter="lookup"))]
    with BatchEngine(bundle, max_batch=4, drafter="feature") as engine:
        results = engine.generate_many(prompts, max_new_tokens=NEW, ignore_eos=True, gamma=3)
    for prompt, res in zip(prompts, results):
        assert res.tokens == torch_greedy(model, prompt, NEW), f"prompt={prompt}"
    assert sum(r.stats.accepted for r in results) > 0


# (drafter, sampling, prompt, stop_below): feature-lookup's prompt ends with a 3-gram seen earlier, so
# lookup drafts the first tokens (a one-hot q) and the head the later ones. "feature-stopped": whether
# a chain goes on depends on q of the token the head drew (the manifest's "stop_below"; the tiny
# head's q is flat at T = 1, its top ~0.1-0.2, hence 0.01).
SAMPLED = {"feature-plain": ("feature", dict(temperature=1.0), PROMPTS[2], 0.0),
           "feature-top_p": ("feature", dict(temperature=1.0, top_p=0.9), PROMPTS[2], 0.0),
           "feature-lookup-plain": ("feature-lookup", dict(temperature=1.0), PROMPTS[2] + PROMPTS[2][:3], 0.0),
           "feature-stopped": ("feature", dict(temperature=1.0), PROMPTS[2], 0.01)}  # fmt: skip


@LLAMA
@pytest.mark.parametrize("case", list(SAMPLED))
def test_feature_drafters_first_two_tokens_follow_the_target(feature_bundle, case, tmp_path):
    target, bundle, _, _ = feature_bundle
    drafter, kw, prompt, stop = SAMPLED[case]
    cfg = SamplingConfig(kw["temperature"], None, kw.get("top_p"))
    p1, p2 = exact_first_two(load_model(target), prompt, cfg)
    dec = SpeculativeDecoder.load(with_stop(bundle, tmp_path / "stop", stop) if stop else bundle, drafter=drafter)
    counts = np.zeros((2, len(p1)), dtype=np.int64)
    accepted = drafted = went_on = 0
    for seed in range(3000):
        res = dec.generate(prompt, max_new_tokens=5, seed=seed, ignore_eos=True, gamma=4, **kw)
        counts[0, res.tokens[0]] += 1
        counts[1, res.tokens[1]] += 1
        accepted += res.stats.accepted_at[0] + res.stats.accepted_at[1]
        drafted += res.stats.drafted_at[0] + res.stats.drafted_at[1]
        went_on += res.stats.drafted_at[1]
    assert 0.05 < accepted / drafted < 0.95, f"acceptance {accepted}/{drafted} does not exercise both paths"
    if stop:
        first = drafted - went_on
        assert 0.05 < went_on / first < 0.95, f"{went_on} of {first} first drafts went on: the stop must both hold and not"
    for i, p in enumerate((p1, p2)):
        assert counts[i][p == 0].sum() == 0, f"token {i + 1}: a token the target cannot produce"
        assert chi_square_p(counts[i], p) > 1e-4, f"{case} token {i + 1}: differs from the target"
        # Power: the counts are clearly not the uniform law nor the target's argmax alone.
        assert chi_square_p(counts[i], np.full(len(p), 1 / len(p))) < 1e-6


@LLAMA
def test_a_failed_training_leaves_the_bundle_as_it_was(family_bundle, tmp_path):
    from specdec.export.train_head import Recipe, train

    bundle = tmp_path / "bundle"
    shutil.copytree(family_bundle[3], bundle)
    before = digests(bundle)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.bin").write_bytes(b"\0")
    with pytest.raises(ConfigError, match="--corpus"):
        train(bundle, str(empty), Recipe(steps=1, windows=2, window=16), report=lambda s: None)
    assert digests(bundle) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".bundle.partial")], "no staging folder left behind"


@LLAMA
def test_feature_drafter_without_a_head_is_refused_in_one_line(family_bundle):
    out = family_bundle[3]
    with pytest.raises(ConfigError, match="train-drafter"):
        SpeculativeDecoder.load(out, drafter="feature")
    run = subprocess.run([sys.executable, "-m", "specdec", "generate", str(out), "--prompt-ids", "1,2,3", "--drafter", "feature"],
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 2 and "train-drafter" in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert json.loads((out / "manifest.json").read_text()).get("head") is None


@LLAMA
def test_feature_lookup_is_the_target_token_for_token_through_both_paths(feature_bundle):
    """Prompt lookup where the context's last tokens occurred before, the head elsewhere: greedy
    output is the target's, one request and several in a batch, with both proposers used."""
    from specdec.runtime.lookup import latest_match

    target, bundle, _, _ = feature_bundle
    model = load_model(target)
    dec = SpeculativeDecoder.load(bundle, drafter="feature-lookup")
    prompts = [PROMPTS[0], *corpus_prompts(dec)]
    matched = unmatched = 0
    for prompt in prompts:
        ref = torch_greedy(model, prompt, NEW)
        for gamma in (1, 3):
            assert dec.generate(prompt, max_new_tokens=NEW, gamma=gamma, ignore_eos=True).tokens == ref, f"gamma={gamma} prompt={prompt}"
        seq = np.array(prompt + ref)
        for L in range(len(prompt), len(seq)):  # which proposer drafted at each length the decode passed
            _, n = latest_match(seq[: L - 1], seq[:L], 3)
            matched, unmatched = matched + (n >= 2), unmatched + (n < 2)
    assert matched >= 10 and unmatched >= 10, f"lookup matched at {matched} lengths, the head drafted at {unmatched}: both must be crossed"
    with BatchEngine(bundle, max_batch=4, drafter="feature-lookup") as engine:
        results = engine.generate_many(prompts, max_new_tokens=NEW, ignore_eos=True, gamma=2)
    for prompt, res in zip(prompts, results):
        assert res.tokens == torch_greedy(model, prompt, NEW), f"batched prompt={prompt}"


def with_stop(bundle: Path, out: Path, stop: float) -> Path:
    """A copy of ``bundle`` (its files hard-linked) whose manifest's drafter entry stops the
    head's chain after a draft the head gives less than ``stop``."""
    for src in bundle.rglob("*"):
        dst = out / src.relative_to(bundle)
        if src.is_dir():
            dst.mkdir(parents=True, exist_ok=True)
        elif src.name != "manifest.json":
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.link(src, dst)
    m = json.loads((bundle / "manifest.json").read_text())
    m["drafter"] = {"name": "feature", "gamma": m["gamma"], "why": "test", "stop_below": stop}
    (out / "manifest.json").write_text(json.dumps(m))
    return out


STOP = 0.6  # the tiny head's top-token probability crosses it both ways on these prompts (asserted below)


@LLAMA
def test_a_chain_stopped_where_the_head_is_unsure_keeps_greedy_exact(feature_bundle, tmp_path):
    """With the manifest's "stop_below", the head drafts fewer tokens a call where it is unsure,
    and greedy output is still the target's, for both head drafters, alone and in a batch."""
    target, bundle, _, _ = feature_bundle
    model = load_model(target)
    stopped = with_stop(bundle, tmp_path / "stop", STOP)
    prompts = [PROMPTS[0], *corpus_prompts(SpeculativeDecoder.load(bundle, drafter="lookup"))]
    short = full = 0
    for drafter in ("feature", "feature-lookup"):
        plain, dec = SpeculativeDecoder.load(bundle, drafter=drafter), SpeculativeDecoder.load(stopped, drafter=drafter)
        assert dec.drafter.stop_below == STOP and plain.drafter.stop_below == 0
        for prompt in prompts:
            ref = torch_greedy(model, prompt, NEW)
            res, before = dec.generate(prompt, max_new_tokens=NEW, gamma=4, ignore_eos=True), plain.generate(prompt, max_new_tokens=NEW, gamma=4, ignore_eos=True)
            assert res.tokens == ref and before.tokens == ref, f"{drafter} prompt={prompt}"
            short, full = short + res.stats.drafted_at[0] - res.stats.drafted_at[3], full + res.stats.drafted_at[3]
    assert short >= 10 and full >= 10, f"{short} calls stopped early, {full} drafted all 4: both must be crossed"
    with BatchEngine(stopped, max_batch=4, drafter="feature") as engine:
        results = engine.generate_many(prompts, max_new_tokens=NEW, ignore_eos=True, gamma=4)
    for prompt, res in zip(prompts, results):
        assert res.tokens == torch_greedy(model, prompt, NEW), f"batched prompt={prompt}"
    shown = subprocess.run([sys.executable, "-m", "specdec", "inspect", str(stopped)], capture_output=True, text=True)
    assert f"the head's chain stops below p = {STOP:g}" in shown.stdout, shown.stdout + shown.stderr


def _draft_with_head(model: Path, head: Path, draft: Path, serve: dict) -> tuple[Path, dict]:
    """``draft``: a copy of the draft model folder with the saved head beside it, its
    head_config.json's "serve" entry set to ``serve``; returns the folder and that config."""
    shutil.copytree(model, draft)
    for f in head.iterdir():
        shutil.copy(f, draft / f.name)
    config = json.loads((draft / "head_config.json").read_text())
    config["serve"] = serve
    (draft / "head_config.json").write_text(json.dumps(config))
    return draft, config


@LLAMA
def test_a_draft_folder_with_a_head_makes_it_the_bundles_default_drafter(feature_bundle, family_bundle, tmp_path):
    """``specdec-export --draft DIR`` where DIR holds a draft model and a saved head: the bundle
    carries both, its default drafter is the fastest measured at export among the bundle's modes,
    the one the head's folder suggests (γ and the head's stop included) among them, and
    ``SpeculativeDecoder.load(B)`` decodes with it, exactly; its matrices are int8 blocks in this
    float32 bundle (float32 with --draft-quantize none); a dynamic-int8 export leaves it out, a
    float16 one keeps it in float16, an int8/int4 one keeps it."""
    from specdec.export.pipeline import ExportConfig

    target, _, _, root = feature_bundle
    draft, config = _draft_with_head(family_bundle[2], root / "head", tmp_path / "draft",
                                     {"drafter": "feature-lookup", "gamma": 2, "stop_below": 0.5, "why": "measured best here"})
    out = tmp_path / "bundle"
    run = subprocess.run([sys.executable, "-c", "from specdec.commands.cli.main import export_main; export_main()", "--target", str(target), "--draft", str(draft), "--out", str(out),
                          "--max-seq-len", "128"], capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    m = json.loads((out / "manifest.json").read_text())
    entry = m["drafter"]
    assert m["head"] is not None and measured_default(entry, "feature-lookup γ=2 stop<0.5"), entry
    assert m["head"]["quantization"] == "int8", "a float32 bundle's head takes int8 blocks unless --draft-quantize none"
    assert m["target"]["quantization"] is None and m["draft"]["quantization"] is None, "only the head's matrices are quantized"
    dec = SpeculativeDecoder.load(out)
    assert dec.drafter_spec == entry["name"] and getattr(dec.drafter, "stop_below", 0.0) == entry.get("stop_below", 0.0)
    model = load_model(target)
    for prompt in [PROMPTS[0], *corpus_prompts(dec)]:
        res = dec.generate(prompt, max_new_tokens=NEW, ignore_eos=True)
        assert res.tokens == torch_greedy(model, prompt, NEW) and res.stats.gamma == entry["gamma"], f"prompt={prompt}"
    assert SpeculativeDecoder.load(out, drafter="model").generate(PROMPTS[0], max_new_tokens=4).stats.gamma == m["gamma"], \
        "another drafter keeps the bundle's gamma"  # fmt: skip
    shown = subprocess.run([sys.executable, "-m", "specdec", "inspect", str(out)], capture_output=True, text=True)
    assert f"default drafter {entry['name']}, gamma {entry['gamma']}" in shown.stdout and "(measured at export" in shown.stdout, shown.stdout + shown.stderr
    fp16 = ExportConfig(str(target), str(draft), tmp_path / "h", dtype="float16")
    assert fp16.head() == draft and fp16.head_quantization() is None, "a float16 bundle keeps the head, in float16"
    assert ExportConfig(str(target), str(draft), tmp_path / "d", quantize="dynamic-int8").head() is None
    assert ExportConfig(str(target), str(draft), tmp_path / "q", quantize="int8").head() == draft, "an int8 bundle keeps it"
    assert ExportConfig(str(target), str(draft), tmp_path / "f").head() == draft
    assert ExportConfig(str(target), str(draft), tmp_path / "n", draft_quantize="none").head_quantization() is None, "--draft-quantize none: float32"


@LLAMA
def test_a_float16_export_keeps_the_head_in_float16(feature_bundle, family_bundle, tmp_path, monkeypatch):
    """A float16 export of a folder with a head keeps it, in float16 (what a GPU runs): its own
    matrices float16, its embedding and LM head the target's float16 tables read from the
    target's file, its context in and features out float32, like the target graphs' features.
    Decoding with it keeps the float16 target's own greedy output token for token (feature,
    feature-lookup and feature-tree), on host buffers and on the device path (KV in OrtValues) through the
    captured runners of provider cuda-graph, the head's calls included (run on the CPU
    provider, where nothing is captured: on a GPU a difference is the capture's)."""
    import onnx

    from specdec.engines import sessions as ort_sessions
    from specdec.engines.captured import CapturedRunner
    from specdec.export.pipeline import ExportConfig, export_bundle

    target, _, _, root = feature_bundle
    draft, _ = _draft_with_head(family_bundle[2], root / "head", tmp_path / "draft", {"drafter": "feature-lookup", "gamma": 2})
    out = tmp_path / "fp16"
    m = export_bundle(ExportConfig(str(target), str(draft), out, max_seq_len=128, dtype="float16", tree_nodes=6))
    assert m.head is not None and m.head.quantization is None and m.dtype == "float16"
    proto = onnx.load(str(out / m.graphs["head_dynamic"].file), load_external_data=False)
    kinds = {t.data_type for t in proto.graph.initializer if len(t.dims) == 2}
    assert kinds == {onnx.TensorProto.FLOAT16}, f"the head's matrices: {kinds}"
    locations = [e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"]
    assert locations.count("target.weights") >= 1, "the head reads the target's float16 tables from the target's file"
    assert m.feature["check"]["max_abs_logits"] > 0
    ref = SpeculativeDecoder.load(out, drafter="lookup")
    prompts = [PROMPTS[0], *corpus_prompts(ref)]
    wants = [ref.generate(p, max_new_tokens=NEW, ignore_eos=True, gamma=0).tokens for p in prompts]

    def decode(drafter: str) -> tuple[list[list[int]], int, SpeculativeDecoder]:
        dec = SpeculativeDecoder.load(out, drafter=drafter)
        results = [dec.generate(p, max_new_tokens=NEW, ignore_eos=True, gamma=3) for p in prompts]
        return [r.tokens for r in results], sum(r.stats.accepted for r in results), dec

    for drafter in ("feature", "feature-lookup", "feature-tree"):
        tokens, accepted, _ = decode(drafter)
        assert tokens == wants and accepted > 0, (drafter, accepted)
    monkeypatch.setitem(ort_sessions.DEVICE, "cpu", "ortvalue")
    monkeypatch.setattr("specdec.engines.executor.CAPTURE", {"cpu"})  # the runners of "cuda-graph", on the CPU provider
    for drafter in ("feature-tree", "feature", "feature-lookup"):
        tokens, accepted, dec = decode(drafter)
        assert tokens == wants and accepted > 0, (drafter, accepted)
        assert drafter != "feature-tree" or dec.engine.target.mover is not None, "the tree's rows moved on the device cache"
    head, target = dec.engine.head, dec.engine.target
    assert isinstance(head.captured[1], CapturedRunner) and head.captured[1].d_context is not None, "the head's steps ran captured"
    assert isinstance(target.captured[4], CapturedRunner) and target.captured[4].d_features is not None, "the verify returned its features"


@LLAMA
def test_a_bundle_that_leaves_the_head_out_takes_the_folders_headless_default(feature_bundle, family_bundle, tmp_path):
    """A dynamic-int8 export of a folder with a head leaves the head out; its default drafter is the
    faster, measured at export, of the draft model and the folder's ``"serve": {"without_head": ...}``
    (Gemma-3-270M's: lookup, as its draft model does not pay), named in the warning, and decodes
    with it (not token for token: dynamic-int8 scales a call's activations together, so it is
    documented as not exact, tests/export/test_export.py); a suggestion it cannot run is ignored."""
    import warnings

    from specdec.export.pipeline import ExportConfig, export_bundle

    target, _, _, root = feature_bundle
    draft, config = _draft_with_head(family_bundle[2], root / "head", tmp_path / "draft",
                                     {"drafter": "feature-lookup", "gamma": 2, "without_head": {"drafter": "lookup", "gamma": 3, "why": "no head here"}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = export_bundle(ExportConfig(str(target), str(draft), tmp_path / "q", max_seq_len=128, quantize="dynamic-int8"))
    assert any("its default drafter is lookup or the draft model" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert m.head is None and measured_default(m.drafter, "lookup γ=3"), m.drafter
    dec = SpeculativeDecoder.load(tmp_path / "q")
    assert dec.drafter_spec == m.drafter["name"]
    for prompt in [PROMPTS[0], *corpus_prompts(dec)]:
        res = dec.generate(prompt, max_new_tokens=NEW, ignore_eos=True)
        assert len(res.tokens) == NEW and res.stats.gamma == m.drafter["gamma"] and res.stats.verify_calls > 0
    config["serve"]["without_head"] = {"drafter": "feature", "gamma": 3}  # needs the head it lacks: ignored
    (draft / "head_config.json").write_text(json.dumps(config))
    assert ExportConfig(str(target), str(draft), tmp_path / "r", quantize="dynamic-int8").head() is None
    from specdec.export.pipeline import headless_drafter

    assert headless_drafter(draft, ExportConfig(str(target), str(draft), tmp_path / "r", quantize="dynamic-int8")) is None


@LLAMA
def test_a_quantized_export_keeps_the_head_in_int8_blocks(feature_bundle, family_bundle, tmp_path):
    """An int8 export of a folder with a head keeps it (int4 too, its head in int8 as its draft): the head's matrices in int8
    blocks (MatMulNBits, the drafts' precision), its embedding the target's own float table in
    the target's file. Its default drafter is the folder's. Decoding keeps the quantized target's
    greedy output up to int8's close calls, one request and a batch. Teacher-forced, the int8 head drafts
    the float head's tokens wherever q8_0's rounding cannot change them."""
    from collections import Counter

    import onnx

    from models import assert_same_up_to_a_close_call

    from specdec.commands.bench.quality import TargetRunner
    from specdec.engines.kv import KVCache
    from specdec.engines.ort import runner_for
    from specdec.export.pipeline import ExportConfig, export_bundle

    target, float_bundle, _, root = feature_bundle
    draft, _ = _draft_with_head(family_bundle[2], root / "head", tmp_path / "draft",
                                {"drafter": "feature-lookup", "gamma": 2, "why": "measured", "int8": {"gamma": 3, "why": "measured on int8"}})
    configs = {q: ExportConfig(str(target), str(draft), tmp_path / "c", quantize=q) for q in ("int8", "int4")}
    heads = {q: (c.head() is not None, c.head_quantization()) for q, c in configs.items()}
    assert heads == {"int8": (True, "int8"), "int4": (True, "int8")}, heads
    out = tmp_path / "int8"
    m = export_bundle(ExportConfig(str(target), str(draft), out, max_seq_len=128, quantize="int8", max_batch=2))
    assert m.head is not None and m.head.quantization == "int8"
    from specdec.export.suggestion import default_drafter

    assert default_drafter(draft, configs["int8"]) == {"name": "feature-lookup", "gamma": 3, "why": "measured on int8"}, "the folder's int8 entry overrides its γ"
    assert measured_default(m.drafter, "feature-lookup γ=3"), m.drafter  # that suggestion among the modes measured at export
    assert m.feature["check"]["max_abs_logits"] > 0, "the check compared the int8 head with the float one"
    proto = onnx.load(str(out / m.graphs["head_dynamic"].file), load_external_data=False)
    ops = Counter(n.op_type for n in proto.graph.node)
    inits = {t.name: t for t in proto.graph.initializer}
    float_matmuls = [n.name for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in inits and len(inits[n.input[1]].dims) == 2
                     and not n.input[1].startswith("block_sum")]  # fmt: skip
    assert ops["MatMulNBits"] >= 5 and not float_matmuls, (ops, float_matmuls)
    bits = {a.i for n in proto.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"}
    assert bits == {8}, f"the head's blocks: {bits} bits"
    locations = {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}
    assert "target.weights" in locations, "the head embeds with the target's float table, not a copy"

    ref = SpeculativeDecoder.load(out, drafter="model")
    dec = SpeculativeDecoder.load(out)
    fdec = SpeculativeDecoder.load(float_bundle, drafter="feature")
    prompts = [PROMPTS[0], *corpus_prompts(dec)]
    own = TargetRunner(out)  # the int8 target's logits, to judge a close call
    wants = [ref.generate(prompt, max_new_tokens=NEW, ignore_eos=True, gamma=0).tokens for prompt in prompts]
    accepted = 0
    for prompt, want in zip(prompts, wants):  # the int8 target's own greedy output, up to int8 close calls (docs/exactness.md)
        res = dec.generate(prompt, max_new_tokens=NEW, ignore_eos=True)
        assert_same_up_to_a_close_call(own, prompt, res.tokens, want, prompt)
        accepted += res.stats.accepted
    assert accepted > 0, "no draft token was kept: the int8 head's path was not crossed"
    # Teacher-forced, on the float target's features of a corpus passage: the int8 head's draft
    # (its argmax) is the float head's wherever the float head's top two logits are apart by
    # more than what q8_0 blocks can move them. q8_0 rounds each weight by at most 1/254 of its
    # block's largest, and MatMulNBits rounds activations the same way: ~1% of the logits' range
    # here (check_head's figure, recorded in the manifest); bound 0.1 of the range, ten times it.
    fm = fdec.manifest
    name, g = fm.graph("target", "dynamic")
    t = fm.target
    ids = np.array(corpus_prompts(dec)[0])
    runner = runner_for(float_bundle, name, g, KVCache(t.num_layers, t.num_kv_heads, fm.max_seq_len, t.head_dim, fm.dtype))
    runner.run(ids)
    context = np.concatenate([np.zeros((1, t.hidden_size), np.float32), runner.features[0, : len(ids) - 1]])  # c_j = f_{j-1}
    logits = {}
    for label, bundle, bm in (("float", float_bundle, fm), ("int8", out, m)):
        cache = KVCache(1, t.num_kv_heads, bm.max_seq_len, t.head_dim, "float32")
        logits[label] = runner_for(bundle, "head_dynamic", bm.graphs["head_dynamic"], cache).run(ids, context).copy()[: len(ids)]
    vocab = np.asarray(logits["float"] > -1e29).all(axis=0)  # the draft vocabulary's columns
    f, q = logits["float"][:, vocab], logits["int8"][:, vocab]
    span = float(f.max() - f.min())
    assert np.abs(q - f).max() <= 0.1 * span, f"int8 head moved logits by {np.abs(q - f).max():.3g}, range {span:.3g}"
    top2 = np.sort(f, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2 * np.abs(q - f).max()
    assert clear.sum() >= len(ids) // 2 and (q.argmax(-1) == f.argmax(-1))[clear].all(), "the int8 head drafts the float head's tokens"
    with BatchEngine(out, max_batch=2) as engine:
        results = engine.generate_many(prompts, max_new_tokens=NEW, ignore_eos=True)
    for prompt, res, want in zip(prompts, results, wants):
        assert_same_up_to_a_close_call(own, prompt, res.tokens, want, f"batched {prompt}")

"""EAGLE-3 heads as their authors save them (export/eagle3.py), against the reference implementation.

A side venv holds vLLM's Speculators (tests/eagle3_venv.py). There, for a tiny target saved here,
tests/eagle3_reference.py builds a random-weight head with Speculators' own config and model
classes, saves it in Speculators' layout or in EAGLE's reference / SpecForge layout, and runs
Speculators' forward on a token sequence (the target's auxiliary streams read by hooks on its
layers). Here the head is exported into a bundle (``--feature-drafter``), and:

- the bundle's draft logits (the target graph's fused features into the head graph, the head's
  cache starting at position 1 as EAGLE-3 reads) equal the reference's;
- greedy decoding with the head is the target's token for token (one request, and a batch);
- sampled decoding's first two tokens follow the target's law (chi-square);
- a head made for another target is refused in one line naming both.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("scipy.stats")

from test_decoder_exact import PROMPTS, chi_square_p, exact_first_two, load_model, torch_greedy  # noqa: E402

from specdec.errors import ConfigError, ExportError  # noqa: E402
from specdec.runtime import BatchEngine, SamplingConfig, SpeculativeDecoder  # noqa: E402

pytestmark = pytest.mark.xdist_group("eagle3")  # one worker makes the venv and the bundles

NEW = 40
TOKENS = [0, 5, 9, 13, 22, 7, 31, 40, 41, 42, 3, 17, 99, 250, 12, 64]  # the conformance sequence
# (family, layout, auxiliary layers of the 3-layer target, draft vocabulary, reference seed)
# seed odd: norm_before_residual. Layer 3 is the final norm's input (vLLM's --include-last-layer).
CASES = {"llama-speculators": ("llama", "speculators", [0, 1, 3], 160, 0),
         "qwen3-speculators": ("qwen3", "speculators", [1, 2, 3], 320, 1),
         "qwen3-eagle": ("qwen3", "eagle", [2, 1, 0], 160, 2),
         "specdec-saved": ("llama", "load", [0, 1, 3], 160, 3)}  # fmt: skip
# "load": the head is made and saved by specdec (export/eagle3_save.py) and loaded by Speculators.
# |Δ logits| bound, float32: ORT's fused attention and norms reorder sums, and the bundle's head
# rows sit at positions one below the reference's (EAGLE-3 trains from position 1; RoPE sees only
# differences, but cos/sin round differently): 1e-6 to 7e-6 seen over the three cases, on logits
# ranging 2.7 to 18. A wrong graph, mapping or first position is off by the logits' own scale.
MAX_DIFF = 1e-4


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> Path:
    """Every case's folder: its target, its head and the reference forward (reference.npz), all
    made by one run of the reference script (its imports take most of a case's time)."""
    from models import save_pair

    root = tmp_path_factory.mktemp("eagle3")
    jobs = []
    for case, (family, layout, aux, vocab, seed) in CASES.items():
        target, _ = save_pair(root / case, family, near=0.3)
        if layout == "load":
            saved_by_specdec(target, root / case / "head", aux, vocab, seed)
        jobs.append([str(target), str(root / case), layout, seed, TOKENS, aux, vocab])
    run_reference(jobs)
    return root


def run_reference(jobs: list[list]) -> None:
    """tests/eagle3_reference.py in the Speculators venv, on ``jobs``."""
    from eagle3_venv import python

    script = Path(__file__).parents[1] / "eagle3_reference.py"
    run = subprocess.run([str(python()), str(script), json.dumps(jobs)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.fixture(scope="module", params=list(CASES))
def eagle3(request, references):
    """(case, target folder, bundle, reference.npz) for one case."""
    from specdec.export.pipeline import ExportConfig, export_bundle

    family = CASES[request.param][0]
    root = references / request.param
    target, draft = root / f"{family}-target", root / f"{family}-draft"
    batch = 2 if request.param == "llama-speculators" else 1
    export_bundle(ExportConfig(str(target), str(draft), root / "bundle", gamma=4, max_seq_len=128, max_batch=batch,
                               feature_drafter=str(root / "head"), draft_quantize="none"))  # a float head: its logits compare with the reference
    return request.param, target, root / "bundle", np.load(root / "reference.npz")


def saved_by_specdec(target: Path, folder: Path, aux: list[int], vocab: int, seed: int) -> None:
    """A fresh head for ``target`` (every other token drafted), in Speculators' layout."""
    from transformers import AutoConfig

    from specdec.export.eagle3_save import new_spec, save

    model = load_model(target)
    cfg = AutoConfig.from_pretrained(target)
    ids = torch.arange(0, 2 * vocab, 2)
    spec = new_spec(cfg, tuple(aux), ids, model.get_input_embeddings().weight.detach(), model.lm_head.weight.detach().T, seed)
    save(spec, folder, str(target), list(cfg.architectures), gamma=4)


def draft_logits(bundle: Path) -> np.ndarray:
    """[T - 1, V]: the bundle's head logits for TOKENS[1:], each with the target graph's fused
    feature of the position before (the head's cache from position 1)."""
    from specdec.engines.kv import KVCache
    from specdec.engines.ort import runner_for
    from specdec.manifest import load_manifest

    m = load_manifest(bundle)
    target_graph, head_graph = m.graph("target", "dynamic"), m.graph("head", "dynamic")
    tk = KVCache(m.target.num_layers, m.target.num_kv_heads, m.max_seq_len, m.target.head_dim, "float32")
    features = runner_for(bundle, *target_graph, tk)
    features.run(np.array(TOKENS))
    g = features.features[0, : len(TOKENS)].copy()  # [T, d]: the fused feature of each position
    h = m.head
    hk = KVCache(1, h.num_kv_heads, m.max_seq_len, h.head_dim, "float32")
    head = runner_for(bundle, *head_graph, hk)
    return head.run(np.array(TOKENS[1:]), g[:-1]).copy()  # [T - 1, V]: token j + 1 with g_j, cache row 0 = position 1


def test_the_bundles_draft_logits_are_the_reference_forward(eagle3):
    from specdec.manifest import load_manifest

    case, _, bundle, ref = eagle3
    m = load_manifest(bundle)
    layout = CASES[case][1]
    assert m.head_first() == 1 and m.feature["training"]["format"].startswith(f"eagle3 ({'speculators' if layout == 'load' else layout})")
    got = draft_logits(bundle)
    vocab = ref["vocab"]
    diff = np.abs(got[:, vocab] - ref["logits"])
    assert diff.max() < MAX_DIFF, f"{case}: the head's logits differ from Speculators' forward by {diff.max():.3g}"
    assert np.ptp(ref["logits"]) > 1.0  # the comparison has a scale to miss by
    outside = np.setdiff1d(np.arange(got.shape[1]), vocab)
    assert (got[:, outside] < -1e8).all(), "a token outside the draft vocabulary got a logit"


def test_greedy_with_an_eagle3_head_is_the_target_token_for_token(eagle3):
    case, target, bundle, _ = eagle3
    model = load_model(target)
    drafters = ("feature", "feature-lookup")
    accepted = 0
    for drafter in drafters:
        dec = SpeculativeDecoder.load(bundle, drafter=drafter)
        for prompt in PROMPTS:  # PROMPTS[1] has one token: the head reads nothing before the first step
            ref = torch_greedy(model, prompt, NEW)
            for gamma in (1, 4):
                res = dec.generate(prompt, max_new_tokens=NEW, gamma=gamma, ignore_eos=True)
                assert res.tokens == ref, f"{case} {drafter} gamma={gamma} prompt={prompt}"
                accepted += res.stats.accepted
    assert accepted > 0, f"{case}: no draft was ever kept: the head's tokens never reach the target"


def test_an_eagle3_head_in_a_batch_keeps_each_row_exact(eagle3):
    case, target, bundle, _ = eagle3
    if case != "llama-speculators":
        pytest.skip("the batched bundle is the llama case's")
    model = load_model(target)
    with BatchEngine(bundle, max_batch=2, drafter="feature") as engine:
        results = engine.generate_many(PROMPTS, max_new_tokens=NEW, ignore_eos=True, gamma=3)
    for prompt, res in zip(PROMPTS, results):
        assert res.tokens == torch_greedy(model, prompt, NEW), f"prompt={prompt}"


def test_sampling_with_an_eagle3_head_keeps_the_targets_law(eagle3):
    case, target, bundle, _ = eagle3
    if case != "qwen3-eagle":
        pytest.skip("one layout's law is tested; the draft logits of every case are the reference's")
    prompt, cfg = PROMPTS[2], SamplingConfig(1.0)
    p1, p2 = exact_first_two(load_model(target), prompt, cfg)
    dec = SpeculativeDecoder.load(bundle, drafter="feature")
    counts = np.zeros((2, len(p1)), dtype=np.int64)
    accepted = drafted = 0
    for seed in range(2000):
        res = dec.generate(prompt, max_new_tokens=3, seed=seed, ignore_eos=True, gamma=3, temperature=1.0)
        counts[0, res.tokens[0]] += 1
        counts[1, res.tokens[1]] += 1
        accepted += res.stats.accepted_at[0]
        drafted += res.stats.drafted_at[0]
    assert 0.02 < accepted / drafted < 0.98, f"acceptance {accepted}/{drafted} does not exercise both paths"
    for i, p in enumerate((p1, p2)):
        assert counts[i][p == 0].sum() == 0, f"token {i + 1}: a token the target cannot produce"
        assert chi_square_p(counts[i], p) > 1e-4, f"{case} token {i + 1}: differs from the target"
        assert chi_square_p(counts[i], np.full(len(p), 1 / len(p))) < 1e-6  # power: not the uniform law


def test_a_head_for_another_target_is_refused_in_one_line(eagle3, tmp_path):
    from models import config_for, make_tokenizer, peaked_model

    from specdec.export.pipeline import ExportConfig, export_bundle

    case, target, bundle, _ = eagle3
    if case != "llama-speculators":
        pytest.skip("one mismatch suffices")
    cfg = config_for("llama")
    cfg.hidden_size, cfg.intermediate_size = 48, 96  # the same vocabulary and layers, another width
    wide = tmp_path / "wide"
    peaked_model(cfg, 0).save_pretrained(wide)
    make_tokenizer(wide)
    head = bundle.parent / "head"
    with pytest.raises(ExportError) as err:
        export_bundle(ExportConfig(str(wide), str(target.parent / "llama-draft"), tmp_path / "out", gamma=2, max_seq_len=64, feature_drafter=str(head)))
    msg = str(err.value)
    assert "\n" not in msg and "hidden size is 48" in msg and str(head) in msg and str(wide) in msg, msg
    assert not (tmp_path / "out").exists(), "a refused export left a bundle behind"


def test_a_folder_that_is_no_head_is_refused_at_the_command_line(tmp_path):
    from specdec.export.pipeline import ExportConfig

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError, match="EAGLE-3 head"):
        ExportConfig("t", "d", tmp_path / "out", feature_drafter=str(tmp_path))


def test_an_eagle3_head_as_the_draft_makes_a_bundle_without_a_draft_model(eagle3, tmp_path):
    """``--draft HEAD``: the user has a target and a published head, no draft model."""
    from specdec.export.pipeline import ExportConfig, export_bundle
    from specdec.manifest import load_manifest

    case, target, bundle, _ = eagle3
    if case != "llama-speculators":
        pytest.skip("one layout suffices: the head is read as with --feature-drafter")
    cfg = ExportConfig(str(target), str(bundle.parent / "head"), tmp_path / "b", gamma=3, max_seq_len=128)
    assert cfg.draft is None and cfg.feature_drafter == str(bundle.parent / "head")
    export_bundle(cfg)
    m = load_manifest(tmp_path / "b")
    assert m.draft is None and not any(g.model == "draft" for g in m.graphs.values())
    assert m.default_drafter()[0] in ("feature", "feature-lookup"), m.drafter
    model = load_model(target)
    dec = SpeculativeDecoder.load(tmp_path / "b")
    for prompt in PROMPTS:
        assert dec.generate(prompt, max_new_tokens=NEW, ignore_eos=True).tokens == torch_greedy(model, prompt, NEW), f"prompt={prompt}"
    with pytest.raises(ConfigError) as err:
        SpeculativeDecoder.load(tmp_path / "b", drafter="model")
    assert "\n" not in str(err.value) and "lacks" in str(err.value)


def test_train_drafter_saves_an_eagle3_head_speculators_loads(eagle3, tmp_path):
    """specdec train-drafter --save-format speculators: an EAGLE-3 head trained here, written into
    the bundle and saved in Speculators' layout; Speculators' loader reads the saved folder and its
    forward equals the bundle's draft logits; greedy decoding with it is the target's."""
    from specdec.export.eagle3_train import train_eagle3
    from specdec.export.pipeline import ExportConfig, export_bundle
    from specdec.export.train_head import Recipe

    case, target, _, _ = eagle3
    if case != "llama-speculators":
        pytest.skip("one target suffices")
    bundle = tmp_path / "b"
    export_bundle(ExportConfig(str(target), str(target.parent / "llama-draft"), bundle, gamma=4, max_seq_len=128))
    record = train_eagle3(bundle, "stdlib", Recipe(steps=60, windows=40, window=64, seed=1), save=tmp_path / "head", report=lambda _: None,
                          layers=(0, 1, 3))  # fmt: skip
    before, after = record["held_out"]["before"], record["held_out"]["after"]
    assert after["alpha_t1"] > before["alpha_t1"] + 0.02, f"training did not move the head: {before} -> {after}"
    run_reference([[str(target), str(tmp_path), "load", 0, TOKENS, [0, 1, 3], 320]])
    ref = np.load(tmp_path / "reference.npz")
    diff = np.abs(draft_logits(bundle)[:, ref["vocab"]] - ref["logits"])
    assert diff.max() < MAX_DIFF, f"Speculators' forward of the saved head differs from the bundle's by {diff.max():.3g}"
    model = load_model(target)
    dec = SpeculativeDecoder.load(bundle, drafter="feature")
    for prompt in PROMPTS:
        assert dec.generate(prompt, max_new_tokens=NEW, gamma=3, ignore_eos=True).tokens == torch_greedy(model, prompt, NEW), f"prompt={prompt}"


def test_a_specdec_head_is_not_trained_over_an_eagle3_bundle(eagle3):
    """Its target graphs return the EAGLE-3 head's fused features, not the LM head's input a
    specdec head trains on: refused in one line, the bundle untouched."""
    from specdec.export.train_head import Recipe, train

    case, _, bundle, _ = eagle3
    if case != "llama-speculators":
        pytest.skip("one bundle suffices")
    before = (bundle / "manifest.json").read_bytes()
    with pytest.raises(ConfigError) as err:
        train(bundle, "stdlib", Recipe(steps=1))
    assert "\n" not in str(err.value) and "EAGLE-3" in str(err.value)
    assert (bundle / "manifest.json").read_bytes() == before

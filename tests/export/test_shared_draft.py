"""A shared draft (export/shared_draft.py): the target's embedding, a head over a vocabulary subset.

The output must stay exactly the target's even though the draft gives q = 0 to every token
outside its subset: greedy token for token, sampled in law (chi-square on the first two tokens,
including tokens only the residual max(0, p - q) can reach). And a shared draft that belongs to
another target is refused before any weights load.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
scipy_stats = pytest.importorskip("scipy.stats")

from models import config_for, make_tokenizer, measured_default, near_copy, peaked_model  # noqa: E402

from specdec.errors import ModelError  # noqa: E402
from specdec.export import shared_draft  # noqa: E402
from specdec.export.pipeline import ExportConfig, export_bundle  # noqa: E402
from specdec.runtime import SamplingConfig, SpeculativeDecoder, standardize  # noqa: E402

PROMPTS = [[5, 17, 42, 99, 7, 3], [200], [31, 31, 31, 64, 128, 250, 12, 9]]
KEEP = 200  # of the 320-token vocabulary: the draft cannot propose the other 120


def _save_shared(target, folder, seed: int, keep: int = KEEP):
    """A near copy of ``target`` (its first 2 layers) as a shared draft over ``keep`` token ids."""
    draft = near_copy(target, 0.1, seed)
    draft.model.layers = draft.model.layers[:2]
    draft.config.num_hidden_layers = 2
    rng = np.random.default_rng(seed)
    ids = sorted({0, 1, 2} | set(rng.choice(np.arange(3, target.config.vocab_size), keep - 3, replace=False).tolist()))
    from transformers import AutoTokenizer

    shared_draft.save(draft, folder, ids, AutoTokenizer.from_pretrained(folder.parent / "target"), dtype=torch.float32)
    return ids


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared")
    target = peaked_model(config_for("llama", "target"), 0)
    target.save_pretrained(root / "target", safe_serialization=True)
    make_tokenizer(root / "target")
    ids = _save_shared(target, root / "draft", seed=1)
    out = root / "bundle"
    manifest = export_bundle(ExportConfig(str(root / "target"), str(root / "draft"), out, gamma=4, max_seq_len=128))
    return root, target, ids, out, manifest


def _greedy(model, prompt, n):
    from transformers import DynamicCache

    cache, out, ids = DynamicCache(), [], torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            tok = int(model(ids, past_key_values=cache, use_cache=True).logits[0, -1].argmax())
            out.append(tok)
            ids = torch.tensor([[tok]])
    return out


def test_the_shipped_files_hold_only_the_drafts_own_weights(shared):
    root, target, ids, out, manifest = shared
    from safetensors import safe_open

    with safe_open(str(root / "draft" / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert names and not any(n.startswith(("model.embed_tokens", "lm_head")) for n in names)
    assert json.loads((root / "draft" / "draft_vocab.json").read_text()) == ids
    assert manifest.draft.num_layers == 2
    assert manifest.validation["draft"]["top1_agreement"] == 1.0


def test_draft_logits_are_fill_outside_its_subset(shared):
    root, target, ids, out, manifest = shared
    from transformers import AutoConfig

    draft = shared_draft.load(root / "draft", AutoConfig.from_pretrained(root / "draft"), target)
    with torch.no_grad():
        logits = draft(torch.tensor([PROMPTS[0]])).logits[0]  # [S, V]
    outside = np.setdiff1d(np.arange(logits.shape[-1]), ids)
    assert torch.all(logits[:, outside] == shared_draft.FILL)
    assert torch.all(logits[:, ids] > shared_draft.FILL / 2)
    # The embedding is the target's: the same tensor values, not a copy trained apart.
    assert torch.equal(draft.get_input_embeddings().weight, target.get_input_embeddings().weight)


def test_greedy_equals_the_target(shared):
    root, target, ids, out, manifest = shared
    dec = SpeculativeDecoder.load(out)
    outside = set(range(manifest.vocab_size)) - set(ids)
    seen_outside = 0
    for prompt in PROMPTS:
        res = dec.generate(prompt, max_new_tokens=60, ignore_eos=True)
        assert res.tokens == _greedy(target, prompt, 60), f"prompt {prompt}"
        seen_outside += sum(t in outside for t in res.tokens)
        assert 0 < res.stats.accepted < res.stats.drafted  # both paths crossed
    assert seen_outside > 0  # tokens the draft cannot propose were emitted (by the target's bonus/residual)


def test_sampled_first_two_tokens_follow_the_target(shared):
    root, target, ids, out, manifest = shared
    cfg = SamplingConfig(1.0, None, None)
    prompt = PROMPTS[2]
    with torch.no_grad():
        p1 = standardize(target(torch.tensor([prompt])).logits[0, -1].double().numpy(), cfg)
        support = np.flatnonzero(p1)
        p2 = p1[support] @ standardize(target(torch.tensor([prompt + [int(t)] for t in support])).logits[:, -1].double().numpy(), cfg)
    dec = SpeculativeDecoder.load(out)
    counts = np.zeros((2, manifest.vocab_size), np.int64)
    for seed in range(3000):
        res = dec.generate(prompt, max_new_tokens=5, seed=seed, ignore_eos=True, temperature=1.0)
        counts[0, res.tokens[0]] += 1
        counts[1, res.tokens[1]] += 1
    outside = np.setdiff1d(np.arange(manifest.vocab_size), ids)
    assert p1[outside].sum() > 0.01  # the target puts mass where the draft has none: the residual must carry it
    for c, p in zip(counts, (p1, p2)):
        assert c[p == 0].sum() == 0
        expected = p * c.sum()
        big = expected >= 5  # Pearson's validity rule; the rest pooled in one bin
        obs = np.append(c[big], c[~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        assert scipy_stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-4  # seeds fixed: deterministic


def test_a_shared_draft_of_another_target_is_refused_before_loading(shared, tmp_path):
    root, target, ids, out, manifest = shared
    other = tmp_path / "draft"
    other.mkdir()
    for f in (root / "draft").iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((other / "config.json").read_text())
    chunks = cfg[shared_draft.KEY]["target_vocab_chunks"]
    assert len(chunks) == 256
    cfg[shared_draft.KEY]["target_vocab_sha256"] = "0" * 64
    cfg[shared_draft.KEY]["target_vocab_chunks"] = [c[::-1] for c in chunks]  # every run of ids another vocabulary's
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="trained for another target vocabulary .*256 of 256 runs of ids differ"):
        export_bundle(ExportConfig(str(root / "target"), str(other), tmp_path / "b1", max_seq_len=64))
    cfg[shared_draft.KEY]["target_vocab_chunks"] = None  # a config of before the runs: its digest alone decides
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="trained for another target vocabulary"):
        export_bundle(ExportConfig(str(root / "target"), str(other), tmp_path / "b1", max_seq_len=64))
    (other / "draft_vocab.json").write_text(json.dumps([5, 3, 4]))
    cfg[shared_draft.KEY]["target_vocab_sha256"] = None
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="ascending token ids"):
        export_bundle(ExportConfig(str(root / "target"), str(other), tmp_path / "b2", max_seq_len=64))
    with pytest.raises(ModelError, match="shared draft"):
        export_bundle(ExportConfig(str(root / "draft"), str(root / "target"), tmp_path / "b3", max_seq_len=64))
    assert not any(p.name.startswith("b") for p in tmp_path.iterdir())  # nothing half-written


def test_a_token_spelled_otherwise_by_another_transformers_passes_with_a_warning(shared):
    """Gemma 3's GGUF names the tab byte twice; transformers 4.57 keeps one name (id 247 left
    without a token), 5.24 names it ``<0x09>``: the whole map's digest differs, one run of ids
    does. The draft is accepted with a warning; three runs differing are another vocabulary."""
    from transformers import AutoTokenizer

    from specdec.export.draft_spec import check_target, target_fields

    root, target, ids, out, manifest = shared
    tok = AutoTokenizer.from_pretrained(root / "target")
    fields = target_fields(tok)
    vocab = tok.get_vocab()

    class Spelled:  # the target's tokenizer as another transformers version reads it
        def __init__(self, changed: list[int]):
            by_id = {i: t for t, i in vocab.items()}
            self.map = {(f"<0x{i:02X}>" if i in changed else t): i for i, t in by_id.items()}

        def get_vocab(self):
            return self.map

    check_target(root / "draft", fields, tok)  # the same: silent
    with pytest.warns(UserWarning, match="1 of 256 runs of the target's vocabulary ids differ"):
        check_target(root / "draft", fields, Spelled([7]))
    per = -(-len(vocab) // 256)
    with pytest.raises(ModelError, match="3 of 256 runs of ids differ"):
        check_target(root / "draft", fields, Spelled([7, 7 + per, 7 + 2 * per]))


def test_a_feature_head_beside_the_shared_draft_is_exported_and_is_the_default(shared, tmp_path):
    """``models/smollm2-draft``'s layout: a shared draft and a feature head in one folder. The
    draft loads without the head's weights, the bundle carries both, and its default drafter
    (measured at export among the bundle's modes, the head's chain at γ = 1 among them: the
    folder suggests nothing) decodes exactly."""
    import shutil

    from models import CORPUS

    from specdec.export.train_head import Recipe, train

    root, target, ids, out, manifest = shared
    staged, corpus = tmp_path / "staged", tmp_path / "corpus"
    shutil.copytree(out, staged)
    corpus.mkdir()
    for i in range(2):
        (corpus / f"part{i}.py").write_text(CORPUS[i * 50 :] + CORPUS[: i * 50])
    train(staged, str(corpus), Recipe(steps=2, batch=2, window=32, windows=8), save=tmp_path / "head", report=lambda s: None)
    draft = tmp_path / "draft"
    shutil.copytree(root / "draft", draft)
    for f in (tmp_path / "head").iterdir():
        shutil.copy(f, draft / f.name)
    m = export_bundle(ExportConfig(str(root / "target"), str(draft), tmp_path / "bundle", gamma=4, max_seq_len=128))
    assert m.head is not None and m.draft.num_layers == 2 and measured_default(m.drafter, "feature γ=1"), m.drafter
    dec = SpeculativeDecoder.load(tmp_path / "bundle")
    assert dec.drafter_spec == m.drafter["name"]
    for prompt in PROMPTS:
        res = dec.generate(prompt, max_new_tokens=40, ignore_eos=True)
        assert res.tokens == _greedy(target, prompt, 40) and res.stats.gamma == m.drafter["gamma"], f"prompt {prompt}"


def test_a_gemma3_shared_draft_loads_as_the_model_it_was_saved_from(tmp_path):
    """Gemma scales its embedding by √hidden with a buffer the weights file does not hold (as
    rotary's inv_freq): the loaded draft must compute what the saved one did (Gemma-3-270M's
    layer-initialized draft once loaded with that buffer unset and drafted nothing)."""
    from transformers import AutoConfig, AutoTokenizer

    target = peaked_model(config_for("gemma3", "target"), 0)
    target.save_pretrained(tmp_path / "target", safe_serialization=True)
    make_tokenizer(tmp_path / "target")
    draft = near_copy(target, 0.1, 1)
    draft.model.layers = draft.model.layers[:1]
    draft.config.num_hidden_layers, draft.config.layer_types = 1, draft.config.layer_types[:1]
    ids = list(range(0, target.config.vocab_size, 2))
    shared_draft.save(draft, tmp_path / "draft", ids, AutoTokenizer.from_pretrained(tmp_path / "target"), dtype=torch.float32)
    loaded = shared_draft.load(tmp_path / "draft", AutoConfig.from_pretrained(tmp_path / "draft"), target)
    prompt = torch.tensor([PROMPTS[2]])
    saved = shared_draft.assemble(draft, target, torch.tensor(ids))  # the in-memory draft with the target's tables
    with torch.no_grad():
        want, got = saved(prompt).logits[0][:, ids], loaded(prompt).logits[0][:, ids]  # [S, V']
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # the same float32 weights: rounding only

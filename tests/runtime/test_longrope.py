"""LongRoPE (Phi-3 128k; Phi-4-mini, whose rotary covers 3/4 of each head): the exported rotary
chooses short or long factors per position, and decoding across the switch equals transformers'
one-token-at-a-time decoding, for the decoder at several γ and for the batched engine
(export/rope.py says why per position)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from models import config_for, make_tokenizer, near_copy, peaked_model, set_rope  # noqa: E402
from test_decoder_exact import first_diff, load_model, torch_greedy  # noqa: E402

from specdec.export import rope  # noqa: E402
from specdec.export.pipeline import ExportConfig, export_bundle  # noqa: E402

ORIGINAL = 32  # original_max_position_embeddings: the switch falls inside every test's sequence


def longrope_config(partial: float = 1.0):
    cfg = config_for("phi3")
    cfg.max_position_embeddings, cfg.original_max_position_embeddings = 256, ORIGINAL
    cfg.partial_rotary_factor = partial
    half = int(cfg.hidden_size // cfg.num_attention_heads * partial) // 2
    set_rope(cfg, type="longrope", short_factor=[1.0 + 0.1 * i for i in range(half)], long_factor=[2.0 + i for i in range(half)])
    return cfg


@pytest.fixture(scope="module", params=[1.0, 0.5], ids=["full-rotary", "partial-rotary"])
def longrope_bundle(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("longrope")
    target = peaked_model(longrope_config(request.param), 0)
    for name, model in (("target", target), ("draft", near_copy(target, 0.1, 1))):
        model.save_pretrained(root / name)
        make_tokenizer(root / name)
    out = root / "bundle"
    # rows graphs for the full rotary only: the per-position factors are the rotary module's
    # (export/rope.py), the same in every graph kind, and partial rotary in rows graphs is the
    # gpt_neox family bundle's (tests/runtime/test_batch.py runs every family's rows); one rows export fewer
    batch = 2 if request.param == 1.0 else 1
    manifest = export_bundle(ExportConfig(str(root / "target"), str(root / "draft"), out, gamma=4, max_seq_len=96, max_batch=batch))
    return root / "target", out, manifest


def test_rotary_chooses_factors_per_position():
    """Each position of a call spanning the switch gets what transformers gives that position
    decoded alone: short factors below ORIGINAL, long from it on."""
    model = peaked_model(longrope_config(), 0)
    ours = peaked_model(longrope_config(), 0)
    assert rope.longrope_by_position(ours) == 1
    x = torch.zeros(1, 1, 4)
    span = torch.arange(ORIGINAL - 3, ORIGINAL + 3)[None]  # [1, 6]
    cos, sin = ours.model.rotary_emb(x, span)
    for i, t in enumerate(span[0].tolist()):
        alone_cos, alone_sin = model.model.rotary_emb(x, torch.tensor([[t]]))  # transformers: max(position) + 1 decides
        torch.testing.assert_close(cos[0, i], alone_cos[0, 0], rtol=0, atol=1e-6)
        torch.testing.assert_close(sin[0, i], alone_sin[0, 0], rtol=0, atol=1e-6)
    # the two factor sets really differ at the switch (else this test could not fail)
    below, _ = model.model.rotary_emb(x, torch.tensor([[ORIGINAL - 1]]))
    at, _ = model.model.rotary_emb(x, torch.tensor([[ORIGINAL]]))
    scale = torch.tensor([ORIGINAL - 1.0, ORIGINAL])
    assert not torch.allclose(below[0, 0].acos() / scale[0], at[0, 0].acos() / scale[1], atol=1e-3)


@pytest.mark.parametrize("gamma", [0, 1, 4])
def test_greedy_across_the_switch_equals_transformers(longrope_bundle, gamma):
    from specdec.runtime.decoder import SpeculativeDecoder

    target, out, manifest = longrope_bundle
    assert manifest.validation["target"]["greedy_mismatches"] == 0
    model, dec = load_model(target), SpeculativeDecoder.load(out)
    for prompt in (list(range(5, 25)), [40, 41, 42, 50, 60]):  # 20 and 5 tokens, 45 new: both cross position 32
        ref = torch_greedy(model, prompt, 45)
        res = dec.generate(prompt, max_new_tokens=45, gamma=gamma, ignore_eos=True)
        assert res.tokens == ref, f"gamma={gamma} prompt={prompt}: first difference at {first_diff(res.tokens, ref)}"
    if gamma:
        assert res.stats.accepted > 0 and res.stats.rejected > 0


def test_batched_rows_across_the_switch_equal_transformers(longrope_bundle):
    """Two rows at different positions in one call: each row's factors are its own positions'."""
    from specdec.runtime.batch import BatchEngine

    target, out, manifest = longrope_bundle
    if manifest.max_batch == 1:
        pytest.skip("rows graphs are exported for the full-rotary bundle only (the fixture says why)")
    model = load_model(target)
    requests = [(list(range(5, 30)), 40), ([7, 8], 50), (list(range(40, 52)), 45)]
    with BatchEngine(out) as engine:
        handles = [engine.submit(p, max_new_tokens=n, gamma=4, ignore_eos=True) for p, n in requests]
        results = [h.result(timeout=300) for h in handles]
    for (prompt, n), res in zip(requests, results):
        ref = torch_greedy(model, prompt, n)
        assert res.tokens == ref, f"prompt {prompt}: first difference at {first_diff(res.tokens, ref)}"

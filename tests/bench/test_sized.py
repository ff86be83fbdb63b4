"""tools/make_sized_pair.py: the presets are the bodies they claim, and the draft is small.

Built on PyTorch's meta device: the model classes lay out every parameter without allocating
them, so a 1B body is checked in a second.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import make_sized_pair  # noqa: E402

# (hidden, layers, heads, KV heads, intermediate, parameters in millions at SmolLM2's vocabulary)
PUBLISHED = {"qwen2.5-0.5b": (896, 24, 14, 2, 4864, 402), "smollm2-360m": (960, 32, 15, 5, 2560, 362),
             "llama-3.2-1b": (2048, 16, 32, 8, 8192, 1073)}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_bodies_and_draft_share(preset):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    sizes = {}
    for draft in (False, True):
        cfg = make_sized_pair.config_for(preset, 49152, 1, 2, draft=draft)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        sizes[draft] = make_sized_pair.weight_bytes(model)
        if not draft:
            hidden, layers, heads, kv, inter, millions = PUBLISHED[preset]
            assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (hidden, layers, heads, kv, inter)
            assert cfg.tie_word_embeddings and sizes[draft] == pytest.approx(millions * 1e6 * 4, rel=0.01)  # fp32, the tied table once
    assert 0.03 < sizes[True] / sizes[False] < 0.10, "the draft should read a few percent of the target's weights per token"


def test_t5_base_preset_is_t5_base_with_t5_small_as_draft():
    """The encoder-decoder preset (batching cost, docs/bench/seq2seq/rows): google-t5/t5-base's
    body (223M parameters at its 32128-token vocabulary; 236M at SmolLM2's 49152), t5-small's as the
    draft. No draft-share bound: it is there for what a call of B rows costs, not for speculation."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForSeq2SeqLM

    assert set(make_sized_pair.PRESETS) == set(PUBLISHED) | {"t5-base"}
    bodies = {}
    for draft in (False, True):
        cfg = make_sized_pair.config_for("t5-base", 49152, 1, 2, draft=draft)
        with torch.device("meta"):
            model = AutoModelForSeq2SeqLM.from_config(cfg)
        bodies[draft] = (cfg.d_model, cfg.num_layers, cfg.num_decoder_layers, cfg.num_heads, cfg.d_ff, cfg.decoder_start_token_id)
        params = sum(p.numel() for p in model.parameters())
        if not draft:
            assert params == pytest.approx(223e6 + (49152 - 32128) * 768, rel=0.01)
    assert bodies == {False: (768, 12, 12, 12, 3072, 0), True: (512, 6, 6, 8, 2048, 0)}

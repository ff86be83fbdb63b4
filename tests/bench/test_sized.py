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


@pytest.mark.parametrize("preset", sorted(make_sized_pair.PRESETS))
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

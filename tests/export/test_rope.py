"""The rotary forward export gives every static rotary (export/rope.py) computes what transformers'
own forward does, bit for bit, on the transformers installed (4.57 writes a MatMul, 5.x a Mul)."""

import inspect
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import config_for, peaked_model, set_rope  # noqa: E402

from specdec.export import rope  # noqa: E402


def rotaries(model) -> list:
    return [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]


@pytest.mark.parametrize("family, scaling", [("llama", {}), ("llama", {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
                                             ("gemma3", {}), ("gpt_neox", {}), ("qwen3", {})])
def test_matmul_rotary_is_transformers_bit_for_bit(family, scaling):
    cfg = config_for(family)
    if scaling:
        set_rope(cfg, **scaling)
    theirs, ours = peaked_model(cfg, 0), peaked_model(cfg, 0)
    assert rope.matmul_rotary(ours) == len(rotaries(ours)) >= 1
    assert all(m.forward.__func__ is rope._outer_product for m in rotaries(ours))
    x = torch.zeros(2, 1, 4)
    positions = torch.tensor([[0, 1, 2, 200], [5, 63, 64, 511]])  # [B, S]: across llama3's original length too
    for mine, ref in zip(rotaries(ours), rotaries(theirs)):
        per_kind = "layer_type" in inspect.signature(ref.forward).parameters  # Gemma 3 on 5.x: a table per layer type
        for kind in sorted(set(cfg.layer_types)) if per_kind else [None]:
            args = (kind,) if kind else ()
            for got, want in zip(mine(x, positions, *args), ref(x, positions, *args)):
                torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_dynamic_rotary_is_left_alone():
    """Dynamic NTK scaling changes its frequencies with the call's length: not static, not rewritten."""
    cfg = config_for("llama")
    set_rope(cfg, type="dynamic", factor=2.0)
    model = peaked_model(cfg, 0)
    assert rope.matmul_rotary(model) == 0

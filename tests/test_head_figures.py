"""The held-out figures a feature head is scored by (export/train_head.py): evaluate at a draft
temperature, the decoded chain. (EAGLE-3's fused features, tools/train/fused_features.py, were
measured and left tools/ with their test; docs/bench/distill/fused-features.)"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from specdec.export.head import FeatureHead, HeadConfig  # noqa: E402
from specdec.export.head_data import Sequences  # noqa: E402
from specdec.export.head_data import collate  # noqa: E402
from specdec.export.train_head import evaluate, first_contexts  # noqa: E402

D, V, K = 32, 64, 3  # feature width, vocabulary, fused blocks (f and two layers)


def _head(seed: int = 0) -> FeatureHead:
    g = torch.Generator().manual_seed(seed)
    embed, head_t = torch.randn(V, D, generator=g), 4 * torch.randn(D, V, generator=g)  # peaked next-token distributions
    torch.manual_seed(seed)
    return FeatureHead(HeadConfig(D, 64, 4, 2, 8, V, 64), embed, head_t).eval()


def _seqs(n: int, rng: np.random.Generator) -> Sequences:
    lengths = rng.integers(12, 24, n)
    feats = [rng.standard_normal((t, K * D)).astype(np.float16) * np.repeat([1.0, 30.0, 200.0], D).astype(np.float16) for t in lengths]  # the layers' scales apart, as a residual stream's are
    return Sequences([rng.integers(0, V, t) for t in lengths], [np.arange(t) >= 4 for t in lengths], feats)


def test_evaluate_at_a_draft_temperature():
    """α at T = 1 when the head drafts from softmax(logits / τ): τ = 1 is the plain figure, and a
    near-zero τ drafts the head's argmax, so α becomes the target's probability of that token."""
    held = _seqs(5, np.random.default_rng(2))
    head = _head(3)
    r = evaluate(head, held, draft_temperatures=(1.0, 0.01))
    assert r["alpha_t1@1"] == r["alpha_t1"]
    ids, mask, f = (torch.from_numpy(x) for x in collate(held, np.arange(len(held)))[:3])
    with torch.no_grad():
        f, ctx = first_contexts(head, f)
        logits, _ = head(ids, torch.arange(ids.shape[1])[None].expand_as(ids), ctx)
        p = torch.softmax(f @ head.full_head_t, -1)
    want = float((p.gather(-1, logits.argmax(-1, keepdim=True))[..., 0] * mask).sum() / mask.sum())
    assert abs(r["alpha_t1@0.01"] - want) < 2e-4  # evaluate rounds to 4 places
    assert r["alpha_t1@0.01"] != r["alpha_t1"]


@pytest.mark.parametrize(
    "run, mask, want",
    [
        # answer positions 1..6: a call at 1 keeps 2 drafts (+ the target's token), at 4 one, at 6 none
        ([0, 2, 0, 0, 1, 0, 0, 0], [0, 1, 1, 1, 1, 1, 1, 0], (6, 3)),
        # a run past the answer's end keeps only what the answer has
        ([3, 3, 0, 0], [1, 1, 1, 0], (3, 1)),
        # nothing kept: a call per token
        ([0, 0, 0], [1, 1, 1], (3, 3)),
        ([], [], (0, 0)),
    ],
)
def test_decoded_calls_count_where_decoding_starts_its_calls(run, mask, want):
    """export/train_head.py ``decoded_calls``: every answer token counted once, a call per
    rejection; positions inside a kept run start no call."""
    from specdec.export.train_head import decoded_calls

    assert decoded_calls(np.asarray(run, int), np.asarray(mask, bool)) == want

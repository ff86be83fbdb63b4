"""Beam search semantics (runtime/beam.py) against ``transformers``' own ``generate(num_beams=w,
do_sample=False)`` on a tiny peaked llama: the same sequences and scores, with and without EOS
reached inside the beams, for each ``early_stopping`` and several length penalties. (Running
beams on the engine and the speculative version, App. A.4, build on this reference.)"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from test_decoder_exact import PROMPTS, load_model  # noqa: E402

from specdec.errors import InputError  # noqa: E402
from specdec.runtime.beam import BeamConfig, search  # noqa: E402


def scorer(model):
    def score(seqs: list[list[int]]) -> np.ndarray:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor(seqs)).logits[:, -1].float(), -1).numpy()

    return score


def hf(model, prompt, cfg: BeamConfig, pad: int):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
                         num_beams=cfg.num_beams, max_new_tokens=cfg.max_new_tokens, length_penalty=cfg.length_penalty,
                         early_stopping=cfg.early_stopping, num_return_sequences=cfg.num_return_sequences,
                         eos_token_id=list(cfg.eos_token_ids), pad_token_id=pad, return_dict_in_generate=True, output_scores=True)  # fmt: skip
    seqs = [s[len(prompt) :].tolist() for s in out.sequences]
    return seqs, out.sequences_scores.tolist()


@pytest.mark.parametrize("early_stopping", [False, True, "never"])
@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_beam_search_equals_transformers(llama_bundle, early_stopping, length_penalty):
    model = load_model(llama_bundle[0])
    score = scorer(model)
    pad = 2
    reached = 0
    for prompt in PROMPTS:
        greedy = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6, pad_token_id=pad, eos_token_id=None)[0, len(prompt) :].tolist()
        for eos in ((), (greedy[3],)):  # no EOS, and a token the output reaches: beams finish at different lengths
            cfg = BeamConfig(4, 12, length_penalty, early_stopping, 2, eos)
            want, want_scores = hf(model, prompt, cfg, pad)
            got = search(prompt, score, cfg)
            for g, w, ws in zip(got, want, want_scores):
                w = w[: len(g.tokens)] if len(w) > len(g.tokens) and all(t == pad for t in w[len(g.tokens) :]) else w
                assert g.tokens == w, (prompt, eos, g.tokens, w)
                # float32 sums of up to 12 log-probs from another forward (HF's KV cache vs a recompute): 3e-6 relative
                assert abs(g.score - ws) <= 3e-6 * abs(ws) + 1e-6, (g.score, ws)
            reached += any(g.tokens[-1:] == list(eos) for g in got) if eos else 0
    assert reached >= 1 or length_penalty > 1  # the EOS cases ended returned beams (a penalty of 2 prefers the long ones)


def test_bad_beam_settings_are_refused():
    with pytest.raises(InputError, match="num_return_sequences=3"):
        BeamConfig(2, 8, num_return_sequences=3)
    with pytest.raises(InputError, match="early_stopping='sometimes'"):
        BeamConfig(2, 8, early_stopping="sometimes")

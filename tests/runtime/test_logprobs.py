"""Logprobs: the target's own log-probabilities of every emitted and prompt token, whatever drafted it.

Each is checked against PyTorch's log-softmax of the target's logits over the whole sequence
(float64), to 1e-4: the graphs and PyTorch order float operations differently (the export
bound on logits is 1e-4 too). Sampled requests at T = 1 with a draft model are the case where
a draft token's probability could leak in; the values must still be the target's.
"""

from __future__ import annotations

import numpy as np
import pytest

from specdec.errors import InputError
from specdec.runtime import SpeculativeDecoder
from specdec.runtime.batch import BatchEngine
from specdec.runtime.logprobs import score

torch = pytest.importorskip("torch")
from test_decoder_exact import PROMPTS, load_model  # noqa: E402

TOL = 1e-4


def reference(model, seq: list[int]) -> np.ndarray:
    """log p(seq[t] | seq[:t]) rows [T, V] for t = 1..T-1 (row t-1 predicts seq[t])."""
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()[:-1]


def check(model, prompt, res, k: int, prompt_k: int | None) -> None:
    seq = list(prompt) + res.tokens
    ref = reference(model, seq)  # row t predicts seq[t + 1]
    assert len(res.logprobs) == len(res.tokens)
    for i, (tok, lp) in enumerate(zip(res.tokens, res.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert lp.token == tok and abs(lp.logprob - row[tok]) < TOL, (i, lp.logprob, row[tok])
        assert len(lp.top) == k and [t for t, _ in lp.top] == [int(t) for t in np.argsort(-row, kind="stable")[:k]]
        assert all(abs(v - row[t]) < TOL for t, v in lp.top)
    if prompt_k is not None:
        assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == len(prompt)
        for t in range(1, len(prompt)):
            lp = res.prompt_logprobs[t]
            assert lp.token == prompt[t] and abs(lp.logprob - ref[t - 1][prompt[t]]) < TOL and len(lp.top) == prompt_k


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_logprobs_are_the_targets_greedy_and_sampled(llama_bundle, drafter):
    target, _, out = llama_bundle
    model = load_model(target)
    dec = SpeculativeDecoder.load(out, drafter=drafter)
    drafted = 0
    for prompt in PROMPTS:
        for kw in (dict(temperature=0), dict(temperature=1.0, seed=3), dict(temperature=0.7, top_k=20, seed=5)):
            res = dec.generate(prompt, max_new_tokens=24, ignore_eos=True, logprobs=3, prompt_logprobs=2, **kw)
            check(model, prompt, res, 3, 2)
            drafted += res.stats.accepted
    assert drafted >= 1, drafted  # accepted draft tokens were scored too


@pytest.mark.parametrize("family_bundle", ["llama", "gemma2", "gpt_neox"], indirect=True)  # RoPE + GQA, soft-capping + windows, parallel residual
def test_logprobs_per_row_in_the_batched_engine(family_bundle):
    """Rows of different lengths in one batched call, each scored against its own sequence;
    a prompt fed in several chunks scores every prompt token."""
    _, target, _, out, _ = family_bundle
    model = load_model(target)
    long = [(7 * i) % 300 + 3 for i in range(70)]  # three prefill chunks
    prompts = [*PROMPTS, long]
    with BatchEngine(out) as engine:
        handles = [engine.submit(p, max_new_tokens=20, ignore_eos=True, logprobs=1, prompt_logprobs=0, temperature=t, seed=1)
                   for p, t in zip(prompts, (0, 1.0, 0, 1.0))]  # fmt: skip
        results = [h.result(timeout=120) for h in handles]
        assert max(engine.occupancy) > 1
    for p, res in zip(prompts, results):
        check(model, p, res, 1, 0)
    assert sum(r.stats.accepted for r in results) >= 10, [r.stats.accepted for r in results]  # draft tokens were scored


def test_score_is_log_softmax_with_sorted_alternatives():
    logits = np.array([[1.0, 3.0, 2.0, 3.0], [0.0, 0.0, 0.0, 10.0]])
    out = score(logits, [2, 3], 3)
    lse = np.log(np.exp(logits).sum(-1))
    assert abs(out[0].logprob - (2.0 - lse[0])) < 1e-12 and [t for t, _ in out[0].top] == [1, 3, 2]  # a tie: lower id first
    assert out[1].top[0][0] == 3 and abs(out[1].top[0][1] - (10 - lse[1])) < 1e-12
    assert score(logits, [0, 0], 0)[0].top == ()
    with pytest.raises(InputError, match="logprobs=21"):
        SpeculativeDecoder.__new__(SpeculativeDecoder)  # no bundle needed: the field is checked by SamplingParams
        from specdec.runtime.params import SamplingParams

        SamplingParams(logprobs=21)

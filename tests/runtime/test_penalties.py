"""Penalties, logit bias and min-p under speculation: the output is the target's under them.

The reference is PyTorch on the target model: Hugging Face's own ``RepetitionPenaltyLogitsProcessor``
and ``MinPLogitsWarper`` (and ``generate(repetition_penalty=...)`` itself for greedy), with
vLLM's frequency and presence penalties and OpenAI's logit bias written out in torch. Greedy
runs are compared token for token, in the decoder and in the batched engine; sampled runs by a
chi-square on the first two tokens (token 2's penalties count token 1, often an accepted draft
of the same speculation window), with the power to tell the penalized law from the plain one.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from transformers.generation.logits_process import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor  # noqa: E402

from test_decoder_exact import P_MIN, PROMPTS, chi_square_p, first_diff, load_model  # noqa: E402

from specdec.errors import InputError, SamplingError  # noqa: E402
from specdec.runtime import SamplingConfig, SpeculativeDecoder, standardize  # noqa: E402
from specdec.runtime.batch import BatchEngine  # noqa: E402
from specdec.runtime.params import SamplingParams  # noqa: E402
from specdec.runtime.penalties import penalize  # noqa: E402

# Strong settings, so that each changes the output of the tiny peaked models
SETTINGS = {
    "repetition": dict(repetition_penalty=1.8),
    "frequency+presence": dict(frequency_penalty=1.5, presence_penalty=2.0),
    "logit_bias": None,  # per prompt: bans the plain output's first token, lowers its fourth (see ``bias_for``)
}


def bias_for(plain: list[int]) -> dict:
    return dict(logit_bias={plain[0]: -100.0, plain[3]: -5.0, 11: 2.0})


def ref_transform(logits: torch.Tensor, prompt: list[int], output: list[int], kw: dict) -> torch.Tensor:
    """The raw logits [V] of one position with ``kw``'s penalties, from its prefix prompt + output."""
    x = logits.double().clone()[None]  # [1, V]
    for t, b in (kw.get("logit_bias") or {}).items():
        x[0, t] += b
    if kw.get("repetition_penalty", 1.0) != 1.0:
        x = RepetitionPenaltyLogitsProcessor(kw["repetition_penalty"])(torch.tensor([prompt + output]), x)
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=x.shape[-1]).double()
    x[0] -= kw.get("frequency_penalty", 0.0) * counts + kw.get("presence_penalty", 0.0) * (counts > 0).double()
    return x[0]


def ref_greedy(model, prompt: list[int], n: int, kw: dict) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([prompt + out])).logits[0, -1]
            out.append(int(ref_transform(logits, prompt, out, kw).argmax()))
    return out


def test_penalize_matches_the_references():
    rng = np.random.default_rng(0)
    V = 64
    for case in range(20):
        logits = rng.normal(0, 3, V)
        prompt = rng.integers(0, V, 10).tolist()
        output = rng.integers(0, V, case % 7).tolist()
        kw = dict(repetition_penalty=[1.0, 1.3, 0.7][case % 3], frequency_penalty=[0.0, 0.5, -1.0][case % 3],
                  presence_penalty=[0.0, 1.0, -0.5][(case + 1) % 3], logit_bias={int(rng.integers(V)): 5.0, 3: -100.0})  # fmt: skip
        pen = SamplingParams(**kw).penalties
        row = logits.copy()
        penalize(row, pen, np.unique(prompt), np.asarray(output, dtype=np.int64))
        ref = ref_transform(torch.tensor(logits), prompt, output, kw).numpy()
        np.testing.assert_allclose(row, ref, rtol=0, atol=1e-12)
    assert SamplingParams().penalties is None and SamplingParams(logit_bias={}).penalties is None


@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_min_p_is_hugging_faces(min_p):
    logits = torch.tensor(np.random.default_rng(1).normal(0, 2, (4, 80)))
    for t in (0.7, 1.0):
        ref = torch.softmax(MinPLogitsWarper(min_p)(None, logits / t), -1).numpy()
        got = standardize(logits.numpy(), SamplingConfig(t, min_p=min_p))
        np.testing.assert_allclose(got, ref, atol=1e-12)
        assert (got == 0).any() and (got > 0).sum(-1).min() >= 1
    with pytest.raises(SamplingError, match="min_p=1.5"):
        SamplingConfig(1.0, min_p=1.5)


LLAMA = pytest.mark.parametrize("family_bundle", ["llama"], indirect=True)  # its draft is a near copy: drafts are accepted


@LLAMA
@pytest.mark.parametrize("drafter", ["model", "lookup"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_with_penalties_is_the_targets(family_bundle, setting, drafter):
    _, target, _, out, _ = family_bundle
    model = load_model(target)
    dec = SpeculativeDecoder.load(out, drafter=drafter)
    accepted = changed = 0
    for prompt in PROMPTS:
        plain = dec.generate(prompt, max_new_tokens=32, ignore_eos=True).tokens
        kw = SETTINGS[setting] or bias_for(plain)
        ref = ref_greedy(model, prompt, 32, kw)
        res = dec.generate(prompt, max_new_tokens=32, ignore_eos=True, **kw)
        assert res.tokens == ref, f"{setting} {prompt}: first difference at {first_diff(res.tokens, ref)}"
        changed += res.tokens != plain
        accepted += res.stats.accepted
    assert changed >= 2, f"{setting} barely changes the output: the test would not see it applied"
    if drafter == "model":  # (prompt lookup's copies are what a repetition penalty avoids)
        assert accepted >= 5, accepted  # draft tokens were tested against penalized rows


@LLAMA
def test_hugging_face_generate_with_repetition_penalty(family_bundle):
    """The same as ``transformers``' own ``generate(repetition_penalty=...)``."""
    _, target, _, out, _ = family_bundle
    model = load_model(target)
    dec = SpeculativeDecoder.load(out)
    for prompt in PROMPTS:
        ids = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
                             max_new_tokens=24, min_new_tokens=24, repetition_penalty=1.5, pad_token_id=0)  # fmt: skip
        assert dec.generate(prompt, max_new_tokens=24, ignore_eos=True, repetition_penalty=1.5).tokens == ids[0, len(prompt) :].tolist()


@LLAMA
def test_batched_rows_with_different_penalties(family_bundle):
    """Rows with each setting, and one with none, decode together in one engine."""
    _, target, _, out, _ = family_bundle
    model = load_model(target)
    with BatchEngine(out) as engine:
        plain = [engine.submit(p, max_new_tokens=24, ignore_eos=True).result(timeout=60).tokens for p in PROMPTS]
        cases = [(p, kw or bias_for(t)) for p, t in zip(PROMPTS, plain) for kw in (*SETTINGS.values(), {})]
        handles = [engine.submit(p, max_new_tokens=24, ignore_eos=True, **kw) for p, kw in cases]
        results = [h.result(timeout=300) for h in handles]
        assert max(engine.occupancy) >= 2
    for (prompt, kw), res in zip(cases, results):
        ref = ref_greedy(model, prompt, 24, kw)
        assert res.tokens == ref, f"{kw} {prompt}: first difference at {first_diff(res.tokens, ref)}"


def exact_first_two(model, prompt: list[int], cfg: SamplingConfig, kw: dict) -> tuple[np.ndarray, np.ndarray]:
    """P(t1), P(t2) of the target under ``cfg`` and ``kw``'s penalties (t2's counting t1)."""
    with torch.no_grad():
        p1 = standardize(ref_transform(model(torch.tensor([prompt])).logits[0, -1], prompt, [], kw).numpy(), cfg)  # [V]
        support = np.flatnonzero(p1)
        logits = model(torch.tensor([prompt + [int(t)] for t in support])).logits[:, -1]  # [|support|, V]
        p2 = np.stack([standardize(ref_transform(row, prompt, [int(t)], kw).numpy(), cfg) for row, t in zip(logits, support)])
    return p1, p1[support] @ p2


SAMPLED = {
    "repetition": dict(repetition_penalty=1.8),
    # negative: token 1 becomes far likelier again at token 2, which gives the test its power
    "frequency+presence": dict(frequency_penalty=-2.0, presence_penalty=-1.5),
    "logit_bias": None,  # from the plain law: the likeliest first token banned, the next lowered, the third raised
    "min_p": dict(min_p=0.1),
}


@LLAMA
@pytest.mark.parametrize("setting", list(SAMPLED))
def test_sampled_law_with_penalties_is_the_targets(family_bundle, setting):
    """3000 seeded runs at T = 1 with the draft model (γ = 4): the first two tokens' counts
    against the target's exact penalized law, and clearly not the unpenalized one."""
    _, target, _, out, _ = family_bundle
    runs, prompt = 3000, PROMPTS[2]
    model = load_model(target)
    plain = exact_first_two(model, prompt, SamplingConfig(1.0), {})
    top = np.argsort(-plain[0], kind="stable")[:3].tolist()
    kw = SAMPLED[setting] or dict(logit_bias={top[0]: -100.0, top[1]: -1.0, top[2]: 1.0})
    cfg = SamplingConfig(1.0, min_p=kw.get("min_p", 0.0))
    p1, p2 = exact_first_two(model, prompt, cfg, kw)
    dec = SpeculativeDecoder.load(out)
    counts = np.zeros((2, len(p1)), dtype=np.int64)
    accepted = drafted = 0
    for seed in range(runs):
        res = dec.generate(prompt, max_new_tokens=3, seed=seed, ignore_eos=True, temperature=1.0, gamma=4, **kw)
        counts[0, res.tokens[0]] += 1
        counts[1, res.tokens[1]] += 1
        accepted += res.stats.accepted_at[0]
        drafted += res.stats.drafted_at[0]
    assert 0.1 < accepted / drafted < 0.95, f"acceptance {accepted}/{drafted} does not exercise both paths"
    powered = False
    for i, (p, q) in enumerate(zip((p1, p2), plain)):
        assert counts[i][p == 0].sum() == 0, f"{setting} token {i + 1}: emitted a token the target cannot produce"
        assert chi_square_p(counts[i], p) > P_MIN, f"{setting} token {i + 1}: differs from the target's penalized law"
        powered |= chi_square_p(counts[i], np.where(q > 0, q, 0) + 1e-12) < 1e-6
    assert powered, f"{setting}: the counts cannot tell the penalized law from the plain one"


@LLAMA
def test_processed_logprobs_are_the_sampled_distribution(family_bundle):
    """``logprobs_mode="processed"``: log of the distribution each token was drawn from."""
    _, target, _, out, _ = family_bundle
    model = load_model(target)
    dec = SpeculativeDecoder.load(out)
    kw = dict(temperature=0.8, top_k=20, min_p=0.02, repetition_penalty=1.3)
    cfg = SamplingConfig(0.8, 20, None, 0.02)
    prompt = PROMPTS[0]
    res = dec.generate(prompt, max_new_tokens=16, ignore_eos=True, seed=2, logprobs=2, logprobs_mode="processed", **kw)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + res.tokens])).logits[0]
    for i, lp in enumerate(res.logprobs):
        probs = standardize(ref_transform(logits[len(prompt) - 1 + i], prompt, res.tokens[:i], kw).numpy(), cfg)
        assert abs(lp.logprob - np.log(probs[lp.token])) < 1e-4
        ranked = np.argsort(-probs, kind="stable")[:2]
        assert [t for t, v in lp.top if v > -np.inf] == [int(t) for t in ranked if probs[t] > 0]  # excluded tokens: -inf, any order
        assert all(v == -np.inf for t, v in lp.top if probs[t] == 0)
    assert res.stats.accepted >= 1


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(presence_penalty=2.5), "presence_penalty=2.5"),
        (dict(frequency_penalty=-3), "frequency_penalty=-3"),
        (dict(repetition_penalty=0), "repetition_penalty=0"),
        (dict(logit_bias={5: 101}), "logit_bias entry 5"),
        (dict(logit_bias={-1: 1}), "logit_bias entry -1"),
        (dict(logit_bias=[1, 2]), "logit_bias=\\[1, 2\\]"),
        (dict(logprobs_mode="logits"), "logprobs_mode='logits'"),
        (dict(max_new_tokens=4, min_tokens=5), "min_tokens=5"),
    ],
)
def test_bad_values_are_refused(kw, match):
    with pytest.raises(InputError, match=match):
        SamplingParams(**kw)


@LLAMA
def test_bias_outside_the_vocabulary_is_refused(family_bundle):
    dec = SpeculativeDecoder.load(family_bundle[3])
    with pytest.raises(InputError, match="logit_bias token id 100000 is outside the vocabulary"):
        dec.generate([5, 6], max_new_tokens=4, logit_bias={100000: 1.0})


@LLAMA
def test_min_tokens_holds_back_the_stop_tokens(family_bundle):
    """min_tokens (vLLM's): EOS and stop_token_ids cannot end the output before that many
    tokens, in the target's and the draft's rows alike; greedy against the PyTorch loop."""
    _, target, _, out, _ = family_bundle
    model = load_model(target)
    dec = SpeculativeDecoder.load(out)
    for prompt in PROMPTS:
        stop = [dec.generate(prompt, max_new_tokens=16, ignore_eos=True).tokens[2]]  # a token the plain output reaches at once
        assert len(dec.generate(prompt, max_new_tokens=16, ignore_eos=True, stop_token_ids=stop).tokens) <= 3
        ref: list[int] = []
        with torch.no_grad():
            while len(ref) < 16 and not (ref and ref[-1] in stop):
                logits = model(torch.tensor([prompt + ref])).logits[0, -1].double()
                if len(ref) < 8:
                    logits[stop] = -float("inf")
                ref.append(int(logits.argmax()))
        res = dec.generate(prompt, max_new_tokens=16, ignore_eos=True, stop_token_ids=stop, min_tokens=8)
        assert res.tokens == ref and len(res.tokens) >= 8, (prompt, res.tokens, ref)

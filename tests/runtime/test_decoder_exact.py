"""The product's promise, end to end: SpeculativeDecoder's output is the target's.

Greedy: token for token against a plain PyTorch argmax loop, for every family, several γ and
prompts, over generations long enough to cross many rejections and fully accepted calls.
Sampling: the first two tokens' marginals over thousands of seeded runs against the exact
target distribution (chi-square), for plain, temperature + top-k and top-p sampling.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
scipy_stats = pytest.importorskip("scipy.stats")

from specdec.runtime import SamplingConfig, SpeculativeDecoder, standardize  # noqa: E402

PROMPTS = [[5, 17, 42, 99, 7, 3], [200], [31, 31, 31, 64, 128, 250, 12, 9]]
NEW = 120  # tokens per greedy generation
P_MIN = 1e-4  # chi-square p-value floor; runs use seeds 0..N-1, so each test is deterministic


def torch_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy decode: a plain argmax loop over HF's KV cache."""
    from transformers import DynamicCache

    cache, out, ids = DynamicCache(), [], torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            logits = model(ids, past_key_values=cache, use_cache=True).logits[0, -1]
            tok = int(logits.argmax())
            out.append(tok)
            ids = torch.tensor([[tok]])
    return out


def load_model(src):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager").eval()


def test_greedy_matches_target_for_every_family(family_bundle):
    family, target, _, out, manifest = family_bundle
    model = load_model(target)
    dec = SpeculativeDecoder.load(out)
    full, rejected, calls = 0, 0, 0
    for prompt in PROMPTS:
        ref = torch_greedy(model, prompt, NEW)
        for gamma in (0, 1, 2, 4):
            res = dec.generate(prompt, max_new_tokens=NEW, gamma=gamma, ignore_eos=True)
            assert res.tokens == ref, f"{family} gamma={gamma} prompt={prompt}: first difference at {first_diff(res.tokens, ref)}"
            s = res.stats
            assert s.new_tokens == NEW and s.finish_reason == "length"
            if gamma:
                full += s.accepted_at[gamma - 1]  # calls that accepted every draft token
                rejected += s.verify_calls - s.accepted_at[gamma - 1]
                calls += s.verify_calls
    # The run must have crossed both rollback paths many times, or it proved little.
    assert rejected >= 20 and full >= 20, f"{family}: {rejected} rejecting and {full} fully accepted calls of {calls}"


def test_greedy_with_a_smaller_draft(llama_bundle):
    """A draft of a different shape (fewer layers and heads) that rarely agrees: many rejections."""
    target, _, out = llama_bundle
    model = load_model(target)
    dec = SpeculativeDecoder.load(out)
    for prompt in PROMPTS:
        ref = torch_greedy(model, prompt, 80)
        for gamma in (1, 3, 4):
            assert dec.generate(prompt, max_new_tokens=80, gamma=gamma, ignore_eos=True).tokens == ref


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


# -- sampling ----------------------------------------------------------------------------------


def exact_first_two(model, prompt: list[int], cfg: SamplingConfig) -> tuple[np.ndarray, np.ndarray]:
    """P(t1) and P(t2) = Σ_t1 P(t1) P(t2 | t1) of the target itself under ``cfg``."""
    with torch.no_grad():
        p1 = standardize(model(torch.tensor([prompt])).logits[0, -1].double().numpy(), cfg)  # [V]
        support = np.flatnonzero(p1)
        batch = torch.tensor([prompt + [int(t)] for t in support])
        p2 = standardize(model(batch).logits[:, -1].double().numpy(), cfg)  # [|support|, V]
    return p1, p1[support] @ p2


NEW_FAMILIES = ("qwen3", "phi3", "gemma3", "gemma2")


def test_first_two_tokens_follow_the_target_in_new_families(family_bundle):
    """The families whose layers differ most from Llama's (Qwen3's q/k norms, Phi-3's fused
    projections, Gemma's sliding windows, per-layer RoPE bases and soft-capping), plain sampling. Parametrized by the fixture's own params (the others skip),
    so that the session-scoped bundles are built once each."""
    if family_bundle[0] not in NEW_FAMILIES:
        pytest.skip("plain-sampling chi-square for the newest families; llama runs every mode below")
    first_two_tokens_follow_the_target(family_bundle, "plain", "model")


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test; bins with expected count < 5 are pooled (the usual validity rule)."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if len(obs) < 3:
        return 1.0  # a single real bin: nothing to test (the power check below then fails)
    if exp[-1] < 5:  # the pooled bin is itself too small: fold it into the largest
        obs, exp = obs[:-1].copy(), exp[:-1].copy()
        obs[exp.argmax()] += counts[~big].sum()
        exp[exp.argmax()] += expected[~big].sum()
    return float(scipy_stats.chisquare(obs, exp * (n / exp.sum())).pvalue)


def runs_for_power(p: np.ndarray, q: np.ndarray, power: float = 0.99, floor: int = 1000, cap: int = 4000) -> int:
    """Seeded runs for a first-token chi-square, chosen by power rather than habit: the fewest
    (a multiple of 100, at least ``floor``) with which the test at P_MIN rejects, with
    probability ``power``, the law of the subtlest bug it exists for: a rejection that samples
    from the target's p itself instead of the residual norm(max(0, p − q)), giving
    min(p, q) + (1 − Σ min(p, q)) p. (A residual of q, or the draft's own law, are told apart
    with fewer runs.) Pearson's statistic is then noncentral chi-square with λ = n Σ (m − p)² / p
    over the bins the test keeps. For the tiny models here that is 450-800 runs; the floor
    leaves room for the binning rules (tests/runtime/test_decoder_exact.py)."""
    mutant = np.minimum(p, q) + (1 - np.minimum(p, q).sum()) * p
    for n in range(floor, cap, 100):
        keep = p * n >= 5
        lam = n * float(((mutant - p) ** 2 / np.where(keep, p, 1.0))[keep].sum())
        df = int(keep.sum())
        if df >= 1 and scipy_stats.ncx2.sf(scipy_stats.chi2.ppf(1 - P_MIN, df), df, lam) >= power:
            return n
    return cap


def check_first_two(results, p1: np.ndarray, p2: np.ndarray, acceptance: tuple[float, float], label: str) -> np.ndarray:
    """Chi-square of the first two tokens of ``results`` against the target's P(t1), P(t2), after
    checking that the acceptance rate of drafts 1-2 lies in ``acceptance`` (both paths crossed).
    Returns the counts [2, V]."""
    counts = np.zeros((2, len(p1)), dtype=np.int64)
    accepted = drafted = 0
    for res in results:
        counts[0, res.tokens[0]] += 1
        counts[1, res.tokens[1]] += 1
        accepted += res.stats.accepted_at[0] + res.stats.accepted_at[1]
        drafted += res.stats.drafted_at[0] + res.stats.drafted_at[1]
    assert acceptance[0] < accepted / drafted < acceptance[1], f"{label}: acceptance {accepted}/{drafted} does not exercise both paths"
    for i, p in enumerate((p1, p2)):
        assert counts[i][p == 0].sum() == 0, f"{label} token {i + 1}: emitted a token the target cannot produce"
        assert chi_square_p(counts[i], p) > P_MIN, f"{label} token {i + 1}: differs from the target"
    return counts


SAMPLING = {
    "plain": dict(temperature=1.0),
    "temperature+top_k": dict(temperature=0.7, top_k=20),
    "top_p": dict(temperature=1.0, top_p=0.9),
}


@pytest.mark.parametrize("family_bundle", ["llama"], indirect=True)  # greedy covers every family
@pytest.mark.parametrize("drafter", ["model", "model-steps"])  # the llama bundle's fused draft graphs, and one call per token
@pytest.mark.parametrize("mode", list(SAMPLING))
def test_first_two_tokens_follow_the_target(family_bundle, mode, drafter):
    first_two_tokens_follow_the_target(family_bundle, mode, drafter)


def first_two_tokens_follow_the_target(family_bundle, mode: str, drafter: str) -> None:
    """Seeded runs (as many as ``runs_for_power`` says): the first two tokens' counts against the
    target's exact distributions (chi-square), with the power to tell them from the draft's."""
    family, target, draft, out, manifest = family_bundle
    kw = SAMPLING[mode]
    cfg = SamplingConfig(kw["temperature"], kw.get("top_k"), kw.get("top_p"))
    prompt = PROMPTS[2]  # its next-token distributions are the least peaked: most bins
    p1, p2 = exact_first_two(load_model(target), prompt, cfg)
    q1, q2 = exact_first_two(load_model(draft), prompt, cfg)
    runs = runs_for_power(p1, q1)
    dec = SpeculativeDecoder.load(out, drafter=drafter)
    fused = family_bundle[0] == "llama" and drafter == "model"  # only the llama bundle has fused draft graphs
    assert (dec.engine.draft.fused(1, cfg.greedy) is not None and dec.drafter.use_fused) == fused  # the path this case is about
    counts = np.zeros((2, manifest.vocab_size), dtype=np.int64)
    accepted, drafted = 0, 0
    for seed in range(runs):
        # 5 new tokens: the first call drafts γ = 4 (the fused graph's γ), so tokens 1-2 come from
        # accepted drafts, residual draws at a rejection, or (after one acceptance and a rejection) both.
        res = dec.generate(prompt, max_new_tokens=5, seed=seed, ignore_eos=True, gamma=manifest.gamma, **kw)
        counts[0, res.tokens[0]] += 1
        counts[1, res.tokens[1]] += 1
        accepted += res.stats.accepted_at[0] + res.stats.accepted_at[1]
        drafted += res.stats.drafted_at[0] + res.stats.drafted_at[1]
    assert 0.1 < accepted / drafted < 0.9, f"acceptance {accepted}/{drafted} does not exercise both paths"
    for i, (p, q) in enumerate(((p1, q1), (p2, q2))):
        assert counts[i][p == 0].sum() == 0, f"token {i + 1}: emitted a token the target cannot produce"
        assert chi_square_p(counts[i], p) > P_MIN, f"{mode} token {i + 1}: differs from the target"
        # Power: the same counts are clearly not the draft's distribution.
        assert chi_square_p(counts[i], np.where(q > 0, q, 0) + 1e-12) < 1e-6, f"{mode} token {i + 1}: test has no power"


@pytest.fixture
def int8_bundle(family_bundle, tmp_path):
    from specdec.export.pipeline import ExportConfig, export_bundle

    _, target, draft, _, _ = family_bundle
    out = tmp_path / "int8"
    # max_kl: a random-weight model loses more than a real one on real text (test_export.py says so)
    export_bundle(ExportConfig(str(target), str(draft), out, gamma=3, max_seq_len=96, quantize="int8", max_kl=1.0))
    return draft, out


@pytest.mark.parametrize("family_bundle", ["llama"], indirect=True)  # the pair the float32 law tests use
def test_first_token_follows_a_quantized_bundles_own_law(int8_bundle):
    """int8 on specdec's kernels: sampled speculative output is the quantized model's, in law.
    The first token over seeded runs at T = 1 against the bundle's own processed distribution
    (autoregressive, its top 20 tokens, the rest pooled in one bin), as many runs as the power to
    tell a rejection that resamples from p instead of the residual needs; the counts must also be
    clearly not the draft's (PyTorch's float draft: the bundle's int8 draft differs from it by far
    less than the two models do)."""
    draft, out = int8_bundle
    dec = SpeculativeDecoder.load(out, drafter="model")
    prompt = PROMPTS[2]
    top = dec.generate(prompt, max_new_tokens=1, gamma=0, temperature=1.0, seed=0, logprobs=20, logprobs_mode="processed").logprobs[0].top
    tokens = [t for t, v in top if v > -np.inf]
    p = np.exp([v for t, v in top if v > -np.inf])
    p = np.append(p, max(0.0, 1.0 - p.sum()))  # [bins]: the top tokens, then the rest
    q_full, _ = exact_first_two(load_model(draft), prompt, SamplingConfig(1.0, None, None))
    q = np.append(q_full[tokens], max(0.0, 1.0 - q_full[tokens].sum()))
    runs = runs_for_power(p, q)
    index = {t: i for i, t in enumerate(tokens)}
    counts = np.zeros(len(p), dtype=np.int64)
    accepted = drafted = 0
    for seed in range(runs):
        res = dec.generate(prompt, max_new_tokens=2, seed=seed, temperature=1.0, ignore_eos=True, gamma=3)
        counts[index.get(res.tokens[0], len(tokens))] += 1
        accepted, drafted = accepted + res.stats.accepted_at[0], drafted + res.stats.drafted_at[0]
    assert 0.1 < accepted / drafted < 0.9, f"acceptance {accepted}/{drafted} does not exercise both paths"
    assert chi_square_p(counts, p) > P_MIN, "the first token differs from the quantized bundle's own law"
    assert chi_square_p(counts, q + 1e-12) < 1e-6, "the test has no power: the counts fit the draft's law too"

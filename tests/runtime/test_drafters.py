"""Every drafter, and adaptive γ, keep the target's output exactly; lenience is labelled.

Greedy: token for token against the target's own argmax loop (PyTorch), for every family.
Sampling: the first two tokens' marginals over thousands of seeded runs against the exact
target distribution (chi-square), as in ``test_decoder_exact``, with prompts built so that
each drafter's proposals are often (not always) accepted.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter

import numpy as np
import pytest

from specdec.errors import BundleError, ConfigError
from specdec.runtime import SpeculativeDecoder
from specdec.ngram_table import NgramTable
from specdec.runtime.adaptive import AdaptiveGamma
from specdec.runtime.drafters import DRAFTERS, BigramCounts, LookupDrafter, NgramDrafter, register
from specdec.runtime.lookup import one_hot
from specdec.runtime.stats import Iteration

torch = pytest.importorskip("torch")
from test_decoder_exact import PROMPTS, check_first_two, exact_first_two, first_diff, load_model, torch_greedy  # noqa: E402

from specdec.runtime import SamplingConfig  # noqa: E402

# -- the pure parts -------------------------------------------------------------------------


def brute_match(seq: list[int], max_n: int, min_n: int) -> int:
    """Reference prompt lookup: for n = max..min, the latest i < L-n with seq[i:i+n] == the last n."""
    L = len(seq)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        for i in range(L - n - 1, -1, -1):
            if seq[i : i + n] == seq[L - n :]:
                return i + n
    return -1


@pytest.mark.parametrize("max_n,min_n", [(1, 1), (3, 1), (4, 2)])
def test_lookup_chain_is_the_latest_longest_suffix_and_the_trees_first_branch(max_n, min_n):
    """Prompt lookup written once (runtime/lookup.py): the chain copies what followed the brute
    force's match, and the lookup tree's first branch is that chain."""
    from specdec.runtime.lookup import lookup_chain, lookup_tree

    rng = np.random.default_rng(0)
    found = 0
    for _ in range(400):
        seq = rng.integers(0, 4, size=int(rng.integers(2, 40)))  # few symbols: many partial matches
        L, want = len(seq), brute_match(seq.tolist(), max_n, min_n)
        buf = np.concatenate([seq, np.full(4, -1)])
        k = lookup_chain(buf, L, 4, None, max_n, min_n)
        assert k == (0 if want < 0 else min(4, L - want)), seq.tolist()
        assert buf[L : L + k].tolist() == seq[want : want + k].tolist()
        tokens, parents = lookup_tree(seq, L, nodes=16, depth=4, max_ngram=max_n, min_ngram=min_n)[:2]
        branch = [tokens[i] for i in range(len(tokens)) if parents[i] == i - 1][:k]  # nodes 0, 1, ... down the first path
        assert branch == buf[L : L + k].tolist(), seq.tolist()
        found += want >= 0
    assert found > 100


def test_lookup_copies_from_a_source_when_its_match_is_longer():
    """Encoder-decoder requests: the source is searched too; the longer match wins, the
    output's own on a tie, and a source match needs a token after it."""
    cfg = SamplingConfig(1.0)
    seq, q = np.zeros(32, dtype=np.int64), np.zeros((4, 40))
    d = LookupDrafter(max_ngram=3)
    d.use_source(np.array([20, 5, 6, 7, 30, 31, 32, 1]))
    seq[:5] = [2, 6, 9, 6, 7]  # "6 7" matches 2 tokens of the source, 1 of the output
    assert d.propose(seq, 5, 4, cfg, None, q) == 4 and seq[5:9].tolist() == [30, 31, 32, 1]
    assert (q[:4].argmax(-1) == [30, 31, 32, 1]).all() and q[:4].sum() == 4  # one-hot rows of what it copied
    seq[:5] = [2, 6, 7, 9, 7]  # "9 7" matches 1 token in both: the output's own continuation wins
    assert d.propose(seq, 5, 4, cfg, None, q) == 2 and seq[5:7].tolist() == [9, 7]
    seq[:3] = [2, 4, 1]  # "1" ends the source: nothing follows it there, and not in the output
    assert d.propose(seq, 3, 4, cfg, None, q) == 0


def test_lookup_proposes_the_continuation_and_one_hot_rows():
    seq = np.zeros(32, dtype=np.int64)
    text = [7, 8, 9, 10, 11, 3, 7, 8]  # "7 8" occurred before, followed by 9 10 11 3
    seq[: len(text)] = text
    q = np.full((6, 12), 0.5)
    k = LookupDrafter(max_ngram=2, max_tokens=3).propose(seq, len(text), 5, SamplingConfig(1.0), None, q)
    assert k == 3 and seq[8:11].tolist() == [9, 10, 11]
    assert (q[:3].argmax(axis=1) == [9, 10, 11]).all() and (q[:3].sum(axis=1) == 1).all()
    assert LookupDrafter().propose(np.array([1, 2, 3, 0]), 3, 4, SamplingConfig(0.0), None, q) == 0  # no earlier 3


def test_ngram_table_counts_like_a_counter():
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 6, size=500)
    table = NgramTable.count(ids, vocab=8)
    pairs = Counter(zip(ids[:-1].tolist(), ids[1:].tolist()))
    for prev in range(8):
        succ = {n: c for (p, n), c in pairs.items() if p == prev}
        want = -1 if not succ else min(succ, key=lambda n: (-succ[n], n))
        assert table.successor[prev] == want
    counts = np.bincount(ids, minlength=8)
    assert table.top == counts.argmax()


def test_online_counts_match_the_corpus_count():
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 7, size=300)
    online = BigramCounts(8)
    online.add(ids[:50].tolist())
    for lo in range(50, 300, 13):  # in pieces, as commits arrive
        online.add(ids[lo : lo + 13].tolist(), int(ids[lo - 1]))
    want = NgramTable.count(ids, 8)
    assert (online.table.successor == want.successor).all() and online.table.top == want.top


def test_ngram_drafter_follows_successors():
    table = NgramTable(np.array([2, -1, 3, 1], dtype=np.int64), top=0)
    seq = np.zeros(16, dtype=np.int64)
    seq[0] = 0
    assert NgramDrafter(4, table).propose(seq, 1, 4, SamplingConfig(0.0), None, None) == 4
    assert seq[1:5].tolist() == [2, 3, 1, 0]  # 1 has no successor: the unigram top
    NgramDrafter(4, table, order=1).propose(seq, 1, 3, SamplingConfig(0.0), None, None)
    assert seq[1:4].tolist() == [0, 0, 0]


@pytest.mark.parametrize("bad", [dict(max_ngram=0), dict(max_ngram=2, min_ngram=3), dict(max_tokens=0)])
def test_lookup_options_are_checked(bad):
    with pytest.raises(ConfigError):
        LookupDrafter(**bad)


# -- greedy: token for token ----------------------------------------------------------------


def repeating(prompt: list[int], model, n: int = 6) -> list[int]:
    """prompt + its greedy continuation + prompt again: lookup and bigrams then have material."""
    return prompt + torch_greedy(model, prompt, n) + prompt


@pytest.mark.parametrize("drafter", ["ngram", "lookup", "hierarchical"])
def test_greedy_matches_target_with_every_drafter(family_bundle, drafter):
    family, target, _, out, _ = family_bundle
    model = load_model(target)
    dec = SpeculativeDecoder.load(out, drafter=drafter)
    accepted = full = rejected = 0
    for prompt in [repeating(PROMPTS[0], model, 30), PROMPTS[2]]:
        ref = torch_greedy(model, prompt, 80)
        for gamma in (2, 4, "auto"):
            res = dec.generate(prompt, max_new_tokens=80, gamma=gamma, ignore_eos=True)
            assert res.tokens == ref, f"{family} {drafter} gamma={gamma}: first difference at {first_diff(res.tokens, ref)}"
            s = res.stats
            accepted += s.accepted
            rejected += s.rejected
            full += s.verify_calls - s.rejected
    # Both paths crossed, or the comparison proved little.
    assert accepted >= 10 and rejected >= 5 and full >= 1, f"{family} {drafter}: accepted {accepted}, rejected calls {rejected}, full {full}"


def test_adaptive_gamma_greedy_matches(family_bundle):
    family, target, _, out, _ = family_bundle
    model = load_model(target)
    dec = SpeculativeDecoder.load(out)
    ref = torch_greedy(model, PROMPTS[0], 120)
    res = dec.generate(PROMPTS[0], max_new_tokens=120, gamma="auto", ignore_eos=True)
    assert res.tokens == ref and res.stats.adaptive
    (policy,) = dec.policies.values()  # kept for the next request at this sampling setting
    assert policy.fit[0] > 0 and not dec.fork().policies  # it timed iterations
    again = dec.generate(PROMPTS[0], max_new_tokens=120, gamma="auto", ignore_eos=True, temperature=0.0)
    assert again.tokens == ref and len(dec.policies) == 1


def feed(policy: AdaptiveGamma, alpha: float, draft: float, line: tuple[float, float], rng, steps: int = 300) -> list[int]:
    """Drive ``policy`` with simulated iterations: i.i.d. acceptances, draft seconds per call and
    target seconds a + b·k; returns the γ it chose."""
    chosen = []
    for _ in range(steps):
        g = policy.next()
        chosen.append(g)
        n = 0
        while n < g and rng.random() < alpha:
            n += 1
        policy.update(Iteration(g, n, g, g * draft, line[0] + line[1] * g, 0.0))
    return chosen


@pytest.mark.parametrize("alpha,draft,line", [(0.9, 0.05, (1.0, 0.02)), (0.7, 0.1, (1.0, 0.1)), (0.8, 0.0, (1.0, 0.3)), (0.5, 0.2, (1.0, 0.0))])
def test_adaptive_gamma_settles_on_the_best_gamma(alpha, draft, line):
    from specdec.runtime.analysis import expected_tokens

    rate = {g: expected_tokens(alpha, g) / (g * draft + line[0] + line[1] * g) for g in range(1, 9)}
    rate[0] = 1 / line[0]
    best = max(rate, key=rate.get)
    chosen = feed(AdaptiveGamma(8), alpha, draft, line, np.random.default_rng(0))
    late = Counter(chosen[100:])
    top = late.most_common(1)[0][0]
    assert rate[top] >= 0.97 * rate[best], (best, late)  # noise in α̂ may pick a near-tie


def test_adaptive_gamma_falls_back_to_plain_decoding_and_probes():
    policy = AdaptiveGamma(8, probe_every=8)
    chosen = feed(policy, 0.05, 0.5, (1.0, 0.1), np.random.default_rng(0), steps=120)
    late = chosen[40:]
    assert late.count(0) >= 0.8 * len(late) and 1 in late  # plain steps, with γ = 1 probes


def acceptance_of(alpha: float, rng, calls: int = 400, width: int = 6, burst: float = 0.0):
    """An ``Acceptance`` fed ``calls`` simulated calls of ``width`` drafts: each kept with
    probability ``alpha``, or with ``burst`` > 0, a call wholly predictable (all kept) with
    probability ``burst`` and i.i.d. at ``alpha`` otherwise (acceptances in stretches)."""
    from specdec.runtime.adaptive import Acceptance

    acc = Acceptance(decay=0.999)
    for _ in range(calls):
        n = width if rng.random() < burst else next((i for i in range(width) if rng.random() >= alpha), width)
        acc.observe(width, n)
    return acc


def test_expected_tokens_per_call_follow_the_measured_positions():
    """``Acceptance.expected``: with i.i.d. acceptances it is Eq. 1 at the measured α (within the
    sampling noise of 400 calls: 0.15 token); with acceptances in stretches (a call either wholly
    predictable or not) it stays near the true tokens per call where Eq. 1 at the MLE α misses by
    more than half a token (the full calls' many successes inflate α)."""
    from specdec.runtime.analysis import expected_tokens

    rng = np.random.default_rng(5)
    iid = acceptance_of(0.7, rng)
    for g in (1, 3, 6):
        assert abs(iid.expected(g) - expected_tokens(0.7, g)) < 0.15, (g, iid.expected(g))
    bursty = acceptance_of(0.3, rng, burst=0.5)
    truth = 0.5 * 7 + 0.5 * expected_tokens(0.3, 6)  # half the calls keep all 6 drafts, half are i.i.d. at 0.3
    # 0.35: the share of full calls in 400 draws is 0.5 ± 0.025 (1σ), 0.14 token at 5.6 tokens apart, plus the prior's pull toward α
    assert abs(bursty.expected(6) - truth) < 0.35 < 0.6 < abs(expected_tokens(bursty.alpha, 6) - truth), (bursty.expected(6), truth, bursty.alpha)


def test_a_batch_gamma_maximizes_the_sum_of_its_rows_tokens_per_second():
    """A batched call verifies every row at the widest row's γ and costs T(γ) whatever each row
    would want, so its γ maximizes Σ_r E_r[tokens](γ) / T(γ) against rows / T(0): checked against
    that sum by brute force, on rows of many acceptance rates. A batch of unpredictable rows makes
    plain decoding pay; and the rows in a call decide its γ."""
    policy = AdaptiveGamma(6, probe_every=10**9)
    rng = np.random.default_rng(3)
    feed(policy, 0.5, 0.05, (1.0, 0.12), rng, steps=60)  # the iteration measured: 0.05 s a draft, the call 1 + 0.12 k

    def brute(rows):
        rates = {g: sum(a.expected(g) for a in rows) / policy.target_time(g) for g in range(1, 7)}
        rates[0] = len(rows) / policy.target_time(0)
        return max(rates, key=rates.get)

    pool = {a: acceptance_of(a, rng) for a in (0.05, 0.3, 0.6, 0.9, 0.95)}
    for alphas in ([0.9], [0.9] * 4, [0.95] + [0.05] * 7, [0.3] * 8, [0.6, 0.05, 0.9, 0.3]):
        rows = [pool[a] for a in alphas]
        assert policy.best(rows) == brute(rows), alphas
    assert policy.best([pool[0.05]] * 8) == 0 and policy.best([pool[0.95]]) >= 3
    policy.gamma = 4
    assert policy.next([pool[0.05]] * 8) == 0  # the rows of this call decide it


@pytest.mark.parametrize("family_bundle", ["llama"], indirect=True)  # a draft close to the target
def test_hierarchical_proposes_what_the_draft_model_would(family_bundle):
    """Greedy: the inner level must not change the draft model's proposals, only save calls."""
    plain = SpeculativeDecoder.load(family_bundle[3])
    hier = plain.fork(drafter="hierarchical")
    model = load_model(family_bundle[1])
    prompt = repeating(PROMPTS[0], model, 30)
    a = plain.generate(prompt, max_new_tokens=60, ignore_eos=True).stats
    b = hier.generate(prompt, max_new_tokens=60, ignore_eos=True).stats
    assert (a.accepted, a.drafted, a.accepted_at) == (b.accepted, b.drafted, b.accepted_at)
    assert b.draft_calls < a.draft_calls, (a.draft_calls, b.draft_calls)


class ScriptDrafter:
    """A user's drafter (the README's example): proposes the tokens a known text has next, e.g. a
    cached answer. Deterministic, so q is one-hot (``one_hot``)."""

    name = "script"

    def __init__(self, script: list[int]):
        self.script, self.calls = np.asarray(script, dtype=np.int64), 0

    def start(self, seq, length):
        self.prompt_length = length

    def propose(self, seq, length, gamma, cfg, rng, q):
        self.calls += 1
        at = length - self.prompt_length
        k = max(0, min(gamma, len(self.script) - at))
        seq[length : length + k] = self.script[at : at + k]
        if not cfg.greedy:
            one_hot(q, seq[length : length + k])
        return k

    def commit(self, seq, length, accepted):
        pass


def test_a_user_drafter_plugs_in(llama_bundle):
    """Any object with the Drafter interface works, passed as is or registered by name; the output
    stays the target's (greedy token for token), and an object without the interface is refused."""
    target, _, out = llama_bundle
    model = load_model(target)
    ref = torch_greedy(model, PROMPTS[0], 40)
    wrong = np.random.default_rng(0).random(len(ref)) < 0.25
    script = [(t + 1) % 320 if w else t for t, w in zip(ref, wrong)]  # a quarter of the tokens are wrong
    dec = SpeculativeDecoder.load(out, drafter=ScriptDrafter(script))
    res = dec.generate(PROMPTS[0], max_new_tokens=40, ignore_eos=True)
    assert res.tokens == ref and res.stats.drafter == "script"
    assert res.stats.accepted >= 10 and res.stats.rejected >= 3, res.stats  # both paths crossed
    register("script")(lambda ctx: ScriptDrafter(script))
    try:
        assert dec.fork(drafter="script").generate(PROMPTS[0], max_new_tokens=40, ignore_eos=True).tokens == ref
    finally:
        DRAFTERS.pop("script")
    with pytest.raises(ConfigError, match="lacks the Drafter interface"):
        SpeculativeDecoder.load(out, drafter=object())


# -- sampling: chi-square on the first two tokens -----------------------------------------


@pytest.mark.parametrize("family_bundle", ["llama"], indirect=True)
@pytest.mark.parametrize("drafter", ["ngram", "lookup", "hierarchical"])
def test_first_two_tokens_follow_the_target_with_every_drafter(family_bundle, drafter):
    family, target, draft, out, manifest = family_bundle
    runs = 3000
    cfg = SamplingConfig(1.0)
    model = load_model(target)
    prompt = repeating(PROMPTS[2], model, 4)  # lookup and bigrams propose the target's greedy path
    p1, p2 = exact_first_two(model, prompt, cfg)
    dec = SpeculativeDecoder.load(out, drafter=drafter)
    results = [dec.generate(prompt, max_new_tokens=4, seed=seed, ignore_eos=True, temperature=1.0) for seed in range(runs)]
    counts = check_first_two(results, p1, p2, (0.05, 0.95), drafter)
    # Power: a drafter that always kept its (deterministic) proposal would put all mass on one token.
    assert counts[0].max() < 0.95 * runs


# -- bundles, CLI, lenience ---------------------------------------------------------------


def test_export_counts_the_corpus_into_the_bundle(llama_bundle):
    from transformers import AutoTokenizer

    from models import CORPUS

    target, _, out = llama_bundle
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["ngram"]
    assert entry["files"] == 1 and entry["skipped"] == 1 and (out / entry["file"]).is_file()
    ids = AutoTokenizer.from_pretrained(target)(CORPUS, add_special_tokens=False)["input_ids"]
    assert entry["tokens"] == len(ids)
    want = NgramTable.count(np.array(ids), manifest["vocab_size"])
    dec = SpeculativeDecoder.load(out, drafter="ngram")
    assert (dec.drafter.table.successor == want.successor).all() and dec.drafter.table.top == want.top
    dec.generate([5, 6], max_new_tokens=3)
    assert dec.drafter.table is dec.drafter.fixed  # the corpus table, not one counted from the prompt


def test_tampered_ngram_table_is_refused(llama_bundle, tmp_path):
    out = tmp_path / "b"
    shutil.copytree(llama_bundle[2], out)
    NgramTable(np.zeros(320, dtype=np.int64), 0).save(out / "ngram.npz")
    with pytest.raises(BundleError, match="ngram.npz"):
        SpeculativeDecoder.load(out, drafter="ngram")


def test_unknown_drafter_is_refused(llama_bundle):
    with pytest.raises(ConfigError, match="drafter='beam'"):
        SpeculativeDecoder.load(llama_bundle[2], drafter="beam")


def test_table_drafters_allocate_no_draft_model(llama_bundle):
    dec = SpeculativeDecoder.load(llama_bundle[2], drafter="lookup")
    assert dec.engine.draft is None and dec.engine.models == (dec.engine.target,)
    assert dec.fork(drafter="model").engine.draft is not None


@pytest.mark.parametrize("family_bundle", ["llama"], indirect=True)  # a draft close to the target
@pytest.mark.parametrize("lenience,temperature", [(0.2, 0.0), (0.3, 1.0)])
def test_lenience_is_labelled_and_accepts_more(family_bundle, lenience, temperature):
    dec = SpeculativeDecoder.load(family_bundle[3])
    exact = lenient = 0
    for seed in range(20):
        kw = dict(max_new_tokens=40, ignore_eos=True, temperature=temperature, seed=seed)
        exact += dec.generate(PROMPTS[0], **kw).stats.accepted
        res = dec.generate(PROMPTS[0], lenience=lenience, **kw)
        lenient += res.stats.accepted
    assert lenient > exact
    assert not res.stats.as_dict()["exact"] and "NOT distributed as the target's" in res.stats.line()
    assert "LENIENCE" not in dec.generate(PROMPTS[0], max_new_tokens=4).stats.line()


@pytest.mark.parametrize("bad", [0.0, 1.5, "x"])
def test_bad_lenience_is_refused(llama_bundle, bad):
    with pytest.raises(ConfigError, match="lenience"):
        SpeculativeDecoder.load(llama_bundle[2]).request([1, 2], lenience=bad)


def test_generate_cli_drafters_and_lenience(llama_bundle):
    from test_cli import run

    out = str(llama_bundle[2])
    ref = json.loads(run("generate", out, "--prompt-ids", "5,6,7,5,6", "--max-new-tokens", "24", "--gamma", "0", "--ignore-eos", "--json").stdout)
    for drafter in DRAFTERS:
        for gamma in ("4", "auto"):
            res = run("generate", out, "--prompt-ids", "5,6,7,5,6", "--max-new-tokens", "24", "--drafter", drafter, "--gamma", gamma,
                      "--ignore-eos", "--json", "--lookup-ngram", "2")
            if DRAFTERS[drafter].needs_head:  # this bundle has no feature head (tests/runtime/test_feature_drafter.py decodes)
                assert res.returncode == 2 and "train-drafter" in res.stderr and "Traceback" not in res.stderr, res.stderr
                continue
            if DRAFTERS[drafter].tree:  # nor a tree graph: refused in one line (tests/runtime/test_tree_decoding.py decodes)
                assert res.returncode == 2 and "--tree-nodes" in res.stderr and "Traceback" not in res.stderr, res.stderr
                continue
            assert res.returncode == 0, res.stderr
            got = json.loads(res.stdout)
            assert got["tokens"] == ref["tokens"] and got["stats"]["drafter"].startswith(drafter if drafter != "hierarchical" else "hier")
    res = run("generate", out, "--prompt", "def", "--max-new-tokens", "8", "--lenience", "0.5")
    assert res.returncode == 0 and "LENIENCE 0.5" in res.stderr
    for args, msg in ((["--drafter", "beam"], "beam"), (["--gamma", "many"], "--gamma 'many'"), (["--lenience", "2"], "lenience=2.0"),
                      (["--lookup-ngram", "0"], "lookup n-gram sizes")):
        res = run("generate", out, "--prompt", "def", *args)
        assert res.returncode == 2 and msg in res.stderr and "Traceback" not in res.stderr, res.stderr

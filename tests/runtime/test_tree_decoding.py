"""Decoding with a tree drafter (``drafter="lookup-tree"``: prompt lookup's candidates as a
trie; ``"feature-tree"``: the feature head's chain with its next most likely tokens as
leaves), verified in one call of the target's tree graph. Greedy output is the target's argmax
loop token for token, in the decoder and in the batched engine (rows with trees of different
shapes, and rows without a tree, in one step); sampled output follows the target's law
(first-two-token chi-square, both acceptance and rejection exercised)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_decoder_exact import chi_square_p, exact_first_two, first_diff, load_model, torch_greedy  # noqa: E402

from specdec.errors import ConfigError  # noqa: E402
from specdec.runtime import SamplingConfig, SpeculativeDecoder  # noqa: E402
from specdec.runtime.batch import BatchEngine  # noqa: E402
from specdec.runtime.row import Row  # noqa: E402

REPEATS = [[5, 9, 2, 7, 5, 9, 2, 7, 5, 9], [40, 41, 42, 40, 41, 43, 40, 41], list(range(3, 30)) + list(range(3, 12)), [200]]


@pytest.fixture(scope="module")
def tree_bundle(tmp_path_factory):
    """The shared llama bundle (tests/bundles.py): a near draft, batched graphs for 2 and 4 rows,
    fused draft graphs and an 8-node tree verify graph."""
    from bundles import cached, returned

    folder = cached(tmp_path_factory, "family", "llama")
    return folder / "llama-target", folder / "bundle", returned(folder)


@pytest.mark.parametrize("gamma", [2, 4])
def test_greedy_tree_decoding_is_the_target(tree_bundle, gamma):
    target, out, _ = tree_bundle
    model, dec = load_model(target), SpeculativeDecoder.load(out, drafter="lookup-tree")
    accepted = 0
    for prompt in REPEATS:
        ref = torch_greedy(model, prompt, 48)
        res = dec.generate(prompt, max_new_tokens=48, gamma=gamma, ignore_eos=True)
        assert res.tokens == ref, f"gamma={gamma} prompt={prompt}: first difference at {first_diff(res.tokens, ref)}"
        accepted += res.stats.accepted
    assert accepted > 20 and dec.engine.target.tree_runner is not None


def test_batched_rows_with_different_trees(tree_bundle):
    target, out, _ = tree_bundle
    model = load_model(target)
    with BatchEngine(out, drafter="lookup-tree") as engine:
        handles = [engine.submit(p, max_new_tokens=40, gamma=g, ignore_eos=True) for p, g in zip(REPEATS, (4, 3, 4, 0))]
        results = [h.result(timeout=120) for h in handles]
        assert max(engine.occupancy) == 4
    for prompt, res in zip(REPEATS, results):
        ref = torch_greedy(model, prompt, 40)
        assert res.tokens == ref, f"prompt {prompt}: first difference at {first_diff(res.tokens, ref)}"


def first_two_counts(dec, prompt: list[int], vocab: int, gamma: int, runs: int = 3000) -> tuple[np.ndarray, int, int]:
    """Counts [2, V] of the first two tokens over ``runs`` seeded T=1 generations, and the
    first position's accepted and drafted totals."""
    counts = np.zeros((2, vocab), dtype=np.int64)
    accepted = drafted = 0
    for seed in range(runs):
        res = dec.generate(prompt, max_new_tokens=4, seed=seed, ignore_eos=True, gamma=gamma, temperature=1.0)
        counts[0, res.tokens[0]] += 1
        counts[1, res.tokens[1]] += 1
        accepted += res.stats.accepted_at[0]
        drafted += res.stats.drafted_at[0]
    return counts, accepted, drafted


def test_sampled_tree_decoding_follows_the_target(tree_bundle):
    """The prompt holds the target's own greedy continuation of its last tokens, and another
    continuation, so the first call verifies a two-branch tree that is often right."""
    target, out, manifest = tree_bundle
    model = load_model(target)
    base = [5, 17, 42, 99]
    prompt = base + torch_greedy(model, base, 5) + [150, 151] + base + [77, 3, 9] + base
    cfg = SamplingConfig(1.0)
    p1, p2 = exact_first_two(model, prompt, cfg)
    dec = SpeculativeDecoder.load(out, drafter="lookup-tree")
    counts, accepted, drafted = first_two_counts(dec, prompt, manifest.vocab_size, gamma=4)
    assert 0.1 < accepted / drafted < 0.9, f"acceptance {accepted}/{drafted} does not exercise both paths"
    for i, p in enumerate((p1, p2)):
        assert counts[i][p == 0].sum() == 0
        assert chi_square_p(counts[i], p) > 1e-4, f"token {i + 1} differs from the target"


def test_near_max_seq_len_the_tree_gives_way_to_plain_steps(tree_bundle, tmp_path):
    """A 32-node tree call writes 32 rows: the last ones of the cache cannot take it (the request
    fills the context to its last row), so those steps decode plainly, still exactly."""
    from specdec.export.pipeline import ExportConfig, export_bundle

    target, _, _ = tree_bundle
    out = tmp_path / "wide"
    manifest = export_bundle(ExportConfig(str(target), str(target), out, gamma=4, max_seq_len=96, tree_nodes=32))
    dec = SpeculativeDecoder.load(out, drafter="lookup-tree")
    prompt = (REPEATS[0] * 10)[:56]
    n = manifest.max_seq_len - len(prompt)  # as far as the request limits allow: the whole context
    res = dec.generate(prompt, max_new_tokens=n, gamma=4, ignore_eos=True)
    assert res.tokens == torch_greedy(load_model(target), prompt, n) and res.stats.accepted > 0


def test_lenience_with_trees(tree_bundle):
    """Lenience (App. A.5) holds for tree drafters as for chains: greedy, every kept draft token
    has p(x) >= l * max p under the target (the target's own tokens are its argmax); sampled,
    more drafts are kept than exactly. The engine takes it, one request and a batch. 1e-4: the
    float32 graph's logits against PyTorch's."""
    target, out, _ = tree_bundle
    model, dec = load_model(target), SpeculativeDecoder.load(out, drafter="lookup-tree")
    lenient = 0.2
    for prompt in REPEATS:
        res = dec.generate(prompt, max_new_tokens=40, gamma=4, ignore_eos=True, lenience=lenient)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + res.tokens])).logits[0, len(prompt) - 1 : -1].double().numpy()  # [n, V]
        gap = logits[np.arange(len(res.tokens)), res.tokens] - logits.max(axis=1)  # [n]
        assert (gap >= np.log(lenient) - 1e-4).all(), f"prompt {prompt}: a token below lenience {lenient}: {gap.min()}"
    kept = {}
    for lenience in (1.0, lenient):
        stats = [dec.generate(REPEATS[2], max_new_tokens=24, gamma=4, seed=s, temperature=1.0, ignore_eos=True, lenience=lenience).stats for s in range(40)]
        kept[lenience] = sum(s.accepted for s in stats) / sum(s.drafted for s in stats)
    assert kept[lenient] > kept[1.0], kept
    with BatchEngine(out, drafter="lookup-tree") as engine:
        handles = [engine.submit(p, max_new_tokens=16, gamma=4, lenience=lenient, ignore_eos=True) for p in REPEATS]
        assert [len(h.result(timeout=120).tokens) for h in handles] == [16] * len(REPEATS)


def test_a_tree_drafter_needs_the_tree_graph(llama_bundle):
    _, _, out = llama_bundle
    with pytest.raises(ConfigError, match="--tree-nodes"):
        SpeculativeDecoder.load(out, drafter="lookup-tree")


def test_fork_opens_the_tree_graph_on_first_use(tree_bundle):
    """A decoder loaded for the draft model switches to the tree drafter (as specdec bench does)."""
    target, out, _ = tree_bundle
    dec = SpeculativeDecoder.load(out)
    assert "target_tree" not in dec.sessions
    tree = dec.fork("lookup-tree")
    assert "target_tree" in dec.sessions and tree.engine.target.tree_runner is not None
    ref = torch_greedy(load_model(target), REPEATS[0], 24)
    assert tree.generate(REPEATS[0], max_new_tokens=24, gamma=4, ignore_eos=True).tokens == ref


@pytest.fixture(scope="module")
def feature_tree_bundle(tree_bundle, tmp_path_factory):
    """The tree bundle with a feature head (its tree graph then returns features too), over a
    draft vocabulary of 256 of the 320 tokens, as the shipped heads draft (sampling.draw_within
    draws each level's first node; the target's other tokens come from the residual)."""
    import shutil

    from models import train_tiny_head

    target, out, _ = tree_bundle
    root = tmp_path_factory.mktemp("feature-tree")
    bundle = root / "bundle"
    shutil.copytree(out, bundle)
    train_tiny_head(bundle, root, draft_vocab=256)
    return target, bundle


def corpus_prompts(dec) -> list[list[int]]:
    from models import CORPUS

    return [dec.codec.encode(CORPUS[a : a + 60], special=False) for a in (0, 130, 260)]


@pytest.mark.parametrize("gamma", [2, 3])  # 7 nodes: 3 and 2 tokens per level
def test_feature_tree_greedy_is_the_target(feature_tree_bundle, gamma):
    target, out = feature_tree_bundle
    model, dec = load_model(target), SpeculativeDecoder.load(out, drafter="feature-tree")
    accepted, kept_rank, tested = 0, [0, 0, 0], 0
    for prompt in [*REPEATS[:2], *corpus_prompts(dec)]:
        ref = torch_greedy(model, prompt, 48)
        res = dec.generate(prompt, max_new_tokens=48, gamma=gamma, ignore_eos=True)
        assert res.tokens == ref, f"gamma={gamma} prompt={prompt}: first difference at {first_diff(res.tokens, ref)}"
        s = res.stats
        assert sum(s.kept_rank) == s.accepted and len(s.kept_rank) <= 7 // gamma  # each kept node counted once, at a rank the tree has
        assert s.accepted <= s.positions_tested <= s.accepted + s.verify_calls  # a call tests the kept positions and at most one more
        kept_rank = [a + b for a, b in zip(kept_rank, s.kept_rank + [0] * 3)]
        accepted, tested = accepted + s.accepted, tested + s.positions_tested
    assert accepted > 20 and kept_rank[1] > 0, f"kept by rank {kept_rank}: no sibling was ever the target's token"


def test_feature_tree_drafts_the_grammars_forced_spans(feature_tree_bundle):
    """A constrained row's forced spans replace the feature tree's draft, as they do a chain's:
    several tokens per target call, the output still the masked argmax (tests/runtime/test_structured.py)."""
    pytest.importorskip("llguidance")
    from test_structured import FORCED, PROMPTS, masked_argmax_loop

    target, out = feature_tree_bundle
    model, dec = load_model(target), SpeculativeDecoder.load(out, drafter="feature-tree")
    res = dec.generate(PROMPTS[0], max_new_tokens=60, gamma=3, structured_outputs=FORCED)
    assert res.tokens == masked_argmax_loop(model, dec, PROMPTS[0], FORCED, 60)
    assert res.stats.finish_reason == "eos" and res.stats.target_calls < 0.6 * len(res.tokens), res.stats


def test_feature_tree_shape(feature_tree_bundle):
    """γ levels of width nodes // γ: the chain node first, its siblings after, the next level under the chain node."""
    _, out = feature_tree_bundle
    dec = SpeculativeDecoder.load(out, drafter="feature-tree")
    proposer, prompt = dec.engine.proposer, corpus_prompts(dec)[0]
    dec.engine.target.forward([0], [np.array(prompt[:-1])])  # the target's features of the prompt, as a prefill writes them
    row = Row(dec.request(prompt, temperature=0.0, max_new_tokens=8), None, 0, np.array(prompt + [0] * 8, dtype=np.int64), None, None, len(prompt), 8)
    for depth, width in ((2, 3), (3, 2), (4, 1)):
        proposer.start(row)
        tokens, parents, q = proposer.tree_for(row, depth)
        assert q is None  # greedy: fixed candidates
        assert len(tokens) == depth * width and parents == [(-1 if j == 0 else (j - 1) * width) for j in range(depth) for _ in range(width)]
        for j in range(depth):
            level = tokens[j * width : (j + 1) * width]
            assert len(set(level)) == width and row.seq[row.length + j] == level[0]  # the chain went on from the level's first node


def test_sampled_feature_tree_draws_siblings_without_replacement(feature_tree_bundle):
    """At T > 0 each level's siblings are distinct draws; sibling i's proposal is q with the
    earlier siblings removed, renormalized (what verification tests it against)."""
    _, out = feature_tree_bundle
    dec = SpeculativeDecoder.load(out, drafter="feature-tree")
    proposer, prompt = dec.engine.proposer, corpus_prompts(dec)[0]
    dec.engine.target.forward([0], [np.array(prompt[:-1])])
    # T = 1.5: flat enough that siblings differ from the top tokens
    row = Row(dec.request(prompt, temperature=1.5, max_new_tokens=8), None, 0, np.array(prompt + [0] * 8, dtype=np.int64), None,
              np.random.default_rng(0), len(prompt), 8)
    not_top = 0
    for _ in range(20):
        proposer.start(row)
        tokens, parents, q = proposer.tree_for(row, 2)  # 7 nodes: 3 per level
        assert len(tokens) == 6 and q.shape == (6, len(q[0])) and np.allclose(q.sum(axis=1), 1.0)
        for lv in (0, 3):
            level = tokens[lv : lv + 3]
            assert len(set(level)) == 3 and all(q[lv + i, level[i]] > 0 for i in range(3))
            for i in (1, 2):
                rest = q[lv].copy()
                rest[level[:i]] = 0.0
                assert np.allclose(q[lv + i], rest / rest.sum())
            not_top += level != sorted(level, key=lambda t: -q[lv, t])
    assert not_top > 0, "the siblings were always the top tokens: not drawn"


def test_feature_tree_rows_of_a_batch_stay_exact(feature_tree_bundle):
    target, out = feature_tree_bundle
    model = load_model(target)
    prompts = [REPEATS[0], *corpus_prompts(SpeculativeDecoder.load(out, drafter="lookup"))]
    with BatchEngine(out, drafter="feature-tree") as engine:
        handles = [engine.submit(p, max_new_tokens=40, gamma=g, ignore_eos=True) for p, g in zip(prompts, (3, 2, 0, 3))]
        results = [h.result(timeout=120) for h in handles]
    for prompt, res in zip(prompts, results):
        assert res.tokens == torch_greedy(model, prompt, 40), f"prompt {prompt}"


def test_feature_tree_sampled_follows_the_target(feature_tree_bundle):
    target, out = feature_tree_bundle
    model = load_model(target)
    dec = SpeculativeDecoder.load(out, drafter="feature-tree")
    prompt = corpus_prompts(dec)[1]
    p1, p2 = exact_first_two(model, prompt, SamplingConfig(1.0))
    counts, accepted, drafted = first_two_counts(dec, prompt, len(p1), gamma=3)
    assert 0.05 < accepted / drafted < 0.95, f"acceptance {accepted}/{drafted} does not exercise both paths"
    for i, p in enumerate((p1, p2)):
        assert counts[i][p == 0].sum() == 0
        assert chi_square_p(counts[i], p) > 1e-4, f"token {i + 1} differs from the target"
        assert chi_square_p(counts[i], np.full(len(p), 1 / len(p))) < 1e-6, "no power"


@pytest.mark.parametrize("kw", [dict(frequency_penalty=0.3, presence_penalty=0.2), dict(repetition_penalty=1.2)])
def test_greedy_tree_decoding_with_penalties_is_the_targets(tree_bundle, kw):
    """Penalties on a tree: each node's row is penalized with its own path's counts (siblings
    differ), greedy against the PyTorch loop with the same penalties; mild ones, so that the
    repeats prompt lookup proposes are still accepted now and then."""
    from test_penalties import ref_greedy

    target, out, _ = tree_bundle
    model, dec = load_model(target), SpeculativeDecoder.load(out, drafter="lookup-tree")
    accepted = changed = 0
    for prompt in REPEATS:
        ref = ref_greedy(model, prompt, 40, kw)
        res = dec.generate(prompt, max_new_tokens=40, ignore_eos=True, **kw)
        assert res.tokens == ref, f"{kw} prompt={prompt}: first difference at {first_diff(res.tokens, ref)}"
        accepted += res.stats.accepted
        changed += res.tokens != dec.generate(prompt, max_new_tokens=40, ignore_eos=True).tokens
    assert accepted >= 5 and changed >= 1, (accepted, changed)

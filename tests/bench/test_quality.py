"""``specdec.commands.bench.quality``: the figures that say whether a changed model is still the model."""

from __future__ import annotations

import numpy as np

from specdec.commands.bench.quality import TargetRunner, code_windows, kept, kl, log_softmax, nll, prose_windows, scores, window_logprobs


def test_figures_on_known_distributions():
    v = 50
    uniform = log_softmax(np.zeros((4, v), np.float32))
    assert np.allclose(np.exp(uniform).sum(-1), 1.0)
    tokens = [3, 7, 1, 9]
    assert np.allclose(nll(uniform, tokens), np.log(v))  # perplexity of a uniform model is V
    assert abs(scores(uniform, uniform, [tokens])["perplexity"] - v) < 1e-9
    peaked = log_softmax(np.eye(v, dtype=np.float32)[[3, 7, 1, 9]] * 10)
    assert np.all(kl(peaked, peaked) < 1e-12)
    # KL(p || uniform) = log V - H(p) > 0, and KL is not symmetric
    p = np.exp(peaked)
    want = np.log(v) + (p * peaked).sum(-1)
    assert np.allclose(kl(peaked, uniform), want) and np.all(kl(peaked, uniform) != kl(uniform, peaked))


def test_kept_counts_up_to_the_first_difference():
    assert kept([1, 2, 3, 4], [1, 2, 3, 4]) == 4
    assert kept([1, 2, 3, 4], [1, 2, 9, 4]) == 2  # equal again after a difference: not counted
    assert kept([5], [6]) == 0 and kept([1, 2], [1, 2, 3]) == 2


def test_a_bundle_against_itself_and_its_own_decoder(llama_bundle):
    """The target graph's window logits: zero KL against themselves, perplexity finite, and the
    last position's argmax is the first greedy token the runtime's decoder produces."""
    from specdec.runtime.decoder import SpeculativeDecoder

    bundle = llama_bundle[2]
    dec = SpeculativeDecoder.load(bundle)
    windows = prose_windows(dec.codec.encode, 1, 40) + code_windows(dec.codec.encode, 1, 40)
    assert [len(w) for w in windows] == [40, 40] and windows[0] != windows[1]
    runner = TargetRunner(bundle)
    logp = window_logprobs([runner.logits(w) for w in windows])
    assert logp.shape == (80, dec.manifest.vocab_size)
    s = scores(logp, logp, windows)
    assert s["mean_kl"] == 0.0 and 1.0 < s["perplexity"] < np.inf  # a random peaked model is confidently wrong on text: large
    first = dec.generate(windows[1], max_new_tokens=1, gamma=0, ignore_eos=True).tokens[0]
    assert int(runner.logits(windows[1])[-1].argmax()) == first

"""Prefix reuse: a request keeps the prefix of its prompt that an idle slot holds, and a session
continues without re-reading its history; outputs are the cold runs' (greedy token for token
against PyTorch, seeded runs equal to the engine without reuse; the sampled law is checked by
tests/runtime/test_batch.py's chi-square, whose 4000 requests of one prompt reuse it)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from test_decoder_exact import PROMPTS, first_diff, load_model, torch_greedy  # noqa: E402

from specdec.errors import ConfigError, InputError  # noqa: E402
from specdec.runtime import SpeculativeDecoder  # noqa: E402
from specdec.runtime.batch import BatchEngine  # noqa: E402
from specdec.runtime.params import SamplingParams  # noqa: E402

LLAMA = pytest.mark.parametrize("family_bundle", ["llama"], indirect=True)
TURNS = [[40, 41, 42, 43], [7, 9, 11], [250, 3, 3, 5, 8]]  # what each "user" turn appends


def conversations(engine: BatchEngine, starts: list[list[int]], n: int, **kw) -> list[list[tuple[list[int], list[int]]]]:
    """Each conversation's (prompt, reply) per turn: the start, then + the reply + the next
    turn's tokens; turns of all conversations submitted together, so they interleave over the slots."""
    history = [list(s) for s in starts]
    turns: list[list[tuple[list[int], list[int]]]] = [[] for _ in starts]
    for turn in TURNS:
        handles = [engine.submit(h, max_new_tokens=n, ignore_eos=True, **kw) for h in history]
        for i, h in enumerate(handles):
            reply = h.result(timeout=300).tokens
            turns[i].append((list(history[i]), reply))
            history[i] += reply + turn
    return turns


@LLAMA
@pytest.mark.parametrize("slots", [2, 6])  # fewer slots than conversations (evictions), and more slots than rows
def test_multi_turn_reuse_is_exact(family_bundle, slots):
    """4 conversations x 3 turns on 2 rows: each turn's reply equals the PyTorch argmax loop on
    its whole prompt; later turns feed only what is new when their slot was kept."""
    _, target, _, out, _ = family_bundle
    model = load_model(target)
    with BatchEngine(out, max_batch=2, cache_slots=slots) as engine:
        turns = conversations(engine, [PROMPTS[0], PROMPTS[1], PROMPTS[2], [77, 78]], 12)
        e = engine.engine
        hits, queries, evictions = e.prefix_hits, e.prefix_queries, e.evictions
    for conv in turns:
        for prompt, reply in conv:
            ref = torch_greedy(model, prompt, 12)
            assert reply == ref, f"first difference at {first_diff(reply, ref)}"
    prompts = [[p for p, _ in conv] for conv in turns]
    assert queries == sum(len(p) for conv in prompts for p in conv)
    # what turns 2 and 3 keep: the previous prompt and reply but its last token (never fed), and one more where the draft is behind
    history = sum(len(conv[t - 1]) + 12 - 2 for conv in prompts for t in (1, 2))
    if slots == 6:  # every conversation keeps its slot
        assert hits >= history - 8 and evictions == 0, (hits, history, evictions)  # -8: a row more where the draft lags
    else:  # two slots for four conversations: later turns find their slot taken, yet decode exactly
        assert evictions > 0 and hits < history / 2, (hits, history, evictions)


@LLAMA
def test_reuse_gives_the_cold_engines_outputs(family_bundle):
    """Greedy and seeded sampled multi-turn conversations, with reuse and without (the same
    requests in the same order): the same tokens."""
    out = family_bundle[3]
    starts = [PROMPTS[0], PROMPTS[2], [5, 6, 7, 8, 9, 10, 11], [200]]
    results = {}
    for reuse in (True, False):
        with BatchEngine(out, max_batch=4, prefix_reuse=reuse) as engine:
            greedy = conversations(engine, starts, 10)
            sampled = conversations(engine, starts, 10, temperature=1.0, seed=9, gamma=3)
            results[reuse] = (greedy, sampled, engine.engine.prefix_hits)
    assert results[True][:2] == results[False][:2]
    assert results[True][2] > 100 and results[False][2] == 0


@LLAMA
@pytest.mark.parametrize("drafter", ["model", "lookup", "ngram", "hierarchical"])
def test_session_turns_equal_cold_generation(family_bundle, drafter):
    """A session's turns equal generate() on the whole sequence (greedy, against PyTorch too),
    with every drafter; only the appended tokens are fed; rewind_to goes back."""
    _, target, _, out, _ = family_bundle
    model = load_model(target)
    dec = SpeculativeDecoder.load(out, drafter=drafter)
    s = dec.session(PROMPTS[0])
    appended = None
    for turn in TURNS:
        before, held = dec.engine.prefix_hits, len(s)
        res = s.generate(max_new_tokens=10, ignore_eos=True)
        assert res.tokens == torch_greedy(model, s.tokens[: len(s) - 10], 10) == s.tokens[-10:]
        if appended is not None:  # the history is kept but the reply's last token (never fed), and a row where the draft lags
            assert dec.engine.prefix_hits - before >= held - appended - 2, (dec.engine.prefix_hits - before, held, appended)
        appended = len(s.append(turn))
    cut = len(PROMPTS[0]) + 10
    s.rewind_to(cut)
    assert len(s) == cut
    pieces = list(s.stream(max_new_tokens=8, ignore_eos=True))
    assert s.tokens[cut:] == [t for p in pieces for t in p.tokens] == torch_greedy(model, s.tokens[:cut], 8)


@LLAMA
def test_a_seeded_session_equals_generate(family_bundle):
    out = family_bundle[3]
    dec = SpeculativeDecoder.load(out)
    s = dec.session(PROMPTS[2])
    kw = dict(max_new_tokens=12, ignore_eos=True, temperature=1.0, seed=4, gamma=4)
    for turn in TURNS:
        prompt = s.tokens
        got = s.generate(**kw).tokens
        assert got == dec.generate(prompt, **kw).tokens
        s.append(turn)


def test_session_misuse_is_refused(llama_bundle):
    dec = SpeculativeDecoder.load(llama_bundle[2])
    s = dec.session()
    with pytest.raises(InputError, match="session is empty"):
        s.generate(max_new_tokens=2)
    with pytest.raises(InputError, match="session is empty"):
        s.stream(max_new_tokens=2)  # checked when called, as decoder.stream is
    s.append([5, 6])
    with pytest.raises(InputError, match="rewind_to\\(3\\)"):
        s.rewind_to(3)
    with pytest.raises(InputError, match="outside the vocabulary"):
        s.append([10**6])
    assert s.tokens == [5, 6] and np.asarray(s.append("def f")).size > 0


@pytest.mark.parametrize("seq2seq_bundle", ["bart"], indirect=True)
def test_sessions_need_a_decoder_only_bundle(seq2seq_bundle):
    with pytest.raises(ConfigError, match="decoder-only"):
        SpeculativeDecoder.load(seq2seq_bundle[3]).session()


def test_cache_slots_are_checked(llama_bundle):
    with pytest.raises(ConfigError, match="cache_slots=0"):
        BatchEngine(llama_bundle[2], cache_slots=0)


@LLAMA
def test_a_cache_salt_keeps_prefixes_to_its_own_requests(family_bundle):
    """cache_salt: a request reuses only the rows a request with its salt left, and copies rows
    only from a row in flight with its salt (n choices of one prompt); outputs never change.
    The by-class counts add up to the totals, and no class names a salt."""
    prompt = [int(t) for t in np.random.default_rng(7).integers(3, 200, 40)]
    with BatchEngine(family_bundle[3], max_batch=2, cache_slots=4) as engine:
        e = engine.engine

        def run(salt, n=1):
            before = (e.prefix_hits, e.shared_tokens)
            handles = engine.submit_together([(prompt, SamplingParams(max_new_tokens=6, ignore_eos=True, cache_salt=salt))] * n)
            tokens = [h.result(timeout=300).tokens for h in handles]
            return tokens, e.prefix_hits - before[0], e.shared_tokens - before[1]

        first, hits, _ = run("alice")
        assert hits == 0
        for salt in ("bob", None):  # another salt, and no salt: a class of its own
            out, hits, _ = run(salt)
            assert out == first and hits == 0
        out, hits, _ = run("alice")
        assert out == first and hits == len(prompt) - 1  # its own prefix: every prompt token but the last
        out, hits, shared = run("carol", n=2)  # two choices with one salt: the second copies the first's rows
        assert out == first * 2 and shared == hits == len(prompt) - 1
        assert sum(c[0] for c in e.by_salt.values()) == e.prefix_queries and sum(c[1] for c in e.by_salt.values()) == e.prefix_hits
        assert set(e.by_salt) == {"none", "request", "tenant"} and e.by_salt["request"][1] == 2 * (len(prompt) - 1)
    with pytest.raises(InputError, match="cache_salt=''"):
        SamplingParams(cache_salt="")

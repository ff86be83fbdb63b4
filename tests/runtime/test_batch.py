"""BatchEngine: every request's output is the target's, whatever shares its batch.

Greedy: token for token against a PyTorch argmax loop per row, for every family, with more
requests than slots (rows join and leave mid-way), prompts of different lengths, and rows
differing in γ (fixed, adaptive, 0) and max tokens, and a prompt fed over several iterations. Sampling: first-two-token marginals over
thousands of seeded requests decoded four at a time (chi-square, as for batch 1).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest

from specdec.errors import ConfigError, InputError, QueueFullError, SamplingError
from specdec.runtime import SamplingConfig, SpeculativeDecoder
from specdec.runtime.params import SamplingParams
from specdec.runtime.batch import PREFILL_CHUNK, BatchEngine

torch = pytest.importorskip("torch")
from test_decoder_exact import PROMPTS, check_first_two, exact_first_two, first_diff, load_model, torch_greedy  # noqa: E402

REQUESTS = [  # (prompt, max_new_tokens, gamma): 8 requests for 4 slots; one prompt takes 3 prefill chunks
    (PROMPTS[0], 60, 4), (PROMPTS[1], 25, "auto"), (PROMPTS[2], 80, 2), ([9, 8, 7, 6, 5, 4, 3, 250, 17], 40, 0),
    ([77], 50, 4), ([12, 250, 12, 250, 12], 70, 3), ([(7 * i) % 300 + 3 for i in range(2 * PREFILL_CHUNK + 6)], 40, "auto"),
    (PROMPTS[0][:3], 33, "auto"),
]


@contextmanager
def all_queued(engine):
    """Hold the engine thread after its first step until every request of the block is queued, so
    the rows overlap however the box schedules the submitting thread (a loaded CI box may not)."""
    queued = threading.Event()
    engine.observer = lambda its: queued.wait(timeout=60)
    try:
        yield
    finally:
        queued.set()
        engine.observer = None


@pytest.mark.parametrize("drafter", ["model", "lookup", "hierarchical"])
def test_batched_greedy_matches_target_per_row(family_bundle, drafter):
    family, target, _, out, manifest = family_bundle
    model = load_model(target)
    with BatchEngine(out, drafter=drafter) as engine:
        handles = [engine.submit(p, max_new_tokens=n, gamma=g, ignore_eos=True) for p, n, g in REQUESTS]
        results = [h.result(timeout=300) for h in handles]
        occupancy = dict(engine.occupancy)
    accepted = rejected = 0
    for (prompt, n, gamma), res in zip(REQUESTS, results):
        ref = torch_greedy(model, prompt, n)
        assert res.tokens == ref, f"{family} {drafter} gamma={gamma} prompt={prompt}: first difference at {first_diff(res.tokens, ref)}"
        assert res.stats.finish_reason == "length" and res.stats.new_tokens == n
        accepted += res.stats.accepted
        rejected += res.stats.rejected
    rows = manifest.max_batch  # 4 for llama, 2 for the other families (tests/bundles.py)
    assert max(occupancy) == rows and min(occupancy) < rows, occupancy  # full calls, and rows joining and leaving
    # both paths crossed (greedy and deterministic, so a fixed floor; Gemma 2's soft-capped
    # model repeats itself enough that prompt lookup rejects only 5 times in 8 requests)
    assert accepted >= 20 and rejected >= 5, (family, drafter, accepted, rejected)


@pytest.mark.parametrize("family_bundle", ["llama"], indirect=True)
def test_batched_sampling_follows_the_target(family_bundle):
    """4000 seeded requests, four in flight at a time and joining as others leave; each finds
    the prompt in its slot (prefix reuse, on by default) or copies it from a row in flight."""
    family, target, draft, out, manifest = family_bundle
    runs, prompt, kw = 4000, PROMPTS[2], dict(temperature=1.0)
    p1, p2 = exact_first_two(load_model(target), prompt, SamplingConfig(1.0))
    with BatchEngine(out, max_queue=runs) as engine:
        assert sorted(engine.engine.draft.fused_runners) == [(b, g) for b in (1, 2, 4) for g in (False, True)]  # the llama bundle drafts fused
        handles = [engine.submit(prompt, max_new_tokens=5 + seed % 3, seed=seed, ignore_eos=True, **kw) for seed in range(runs)]
        results = [h.result(timeout=600) for h in handles]
        assert engine.occupancy[4] > runs / 8, engine.occupancy  # most calls ran full batches
        assert engine.engine.prefix_hits > runs * (len(prompt) - 2)  # the law holds with the prompt kept from slot to slot (prefix reuse)
    counts = check_first_two(results, p1, p2, (0.1, 0.9), "batched")
    assert counts[0].max() < 0.95 * runs  # power: not a constant


@pytest.mark.parametrize("family_bundle", ["llama"], indirect=True)
def test_a_lone_seeded_request_equals_the_single_request_decoder(family_bundle):
    """Alone in the engine, a seeded sampled request at fixed γ draws the same numbers as
    SpeculativeDecoder: the same tokens (reproducible for a given schedule)."""
    out = family_bundle[3]
    dec = SpeculativeDecoder.load(out)
    with BatchEngine(out) as engine:
        for seed in range(5):
            kw = dict(max_new_tokens=30, temperature=0.9, top_k=40, seed=seed, gamma=3, ignore_eos=True)
            assert engine.submit(PROMPTS[0], **kw).result(timeout=60).tokens == dec.generate(PROMPTS[0], **kw).tokens


@pytest.mark.parametrize("family_bundle", ["llama"], indirect=True)
def test_cancel_frees_the_slot_and_bad_requests_disturb_nothing(family_bundle):
    family, target, _, out, manifest = family_bundle
    model = load_model(target)
    ref = torch_greedy(model, PROMPTS[0], 60)
    with BatchEngine(out, max_batch=2, max_queue=4) as engine:
        long = engine.submit(PROMPTS[1], max_new_tokens=150, ignore_eos=True)
        good = engine.submit(PROMPTS[0], max_new_tokens=60, ignore_eos=True)
        first = next(iter(long))  # long is decoding
        assert first.tokens
        bad = [(dict(prompt=[5, manifest.vocab_size]), InputError), (dict(prompt=[5] * 200), InputError),
               (dict(prompt=[5], temperature=-1), SamplingError), (dict(prompt=[5], top_p=2.0), SamplingError),
               (dict(prompt=[5], gamma=9), ConfigError), (dict(prompt=[], max_new_tokens=3), InputError)]  # fmt: skip
        for kw, err in bad:
            with pytest.raises(err) as e:
                engine.submit(**kw)
            assert "\n" not in str(e.value)
        long.cancel()
        done = long.result(timeout=30)
        assert done.stats.finish_reason == "cancelled" and len(done.tokens) < 150
        after = engine.submit(PROMPTS[2], max_new_tokens=20, ignore_eos=True)  # takes the freed slot
        assert after.result(timeout=60).tokens == torch_greedy(model, PROMPTS[2], 20)
        assert good.result(timeout=60).tokens == ref  # the bad requests and the cancel did not disturb it
        assert engine.active == 0


@pytest.mark.parametrize("family_bundle", ["llama"], indirect=True)
def test_a_user_drafter_object_runs_per_row(family_bundle):
    """A user's Drafter object (copied per slot) runs in the batched engine too: every row keeps
    the target's greedy output while its own script proposes, right or wrong."""
    from test_drafters import ScriptDrafter

    family, target, _, out, _ = family_bundle
    model = load_model(target)
    refs = [torch_greedy(model, p, 40) for p in PROMPTS]
    # one object for every row: the script is the first prompt's answer, a quarter of it wrong
    wrong = np.random.default_rng(0).random(40) < 0.25
    script = [(t + 1) % 320 if w else t for t, w in zip(refs[0], wrong)]
    with BatchEngine(out, drafter=ScriptDrafter(script)) as engine:
        with all_queued(engine):
            handles = [engine.submit(p, max_new_tokens=40, ignore_eos=True) for p in PROMPTS]
        results = [h.result(timeout=120) for h in handles]
        assert engine.occupancy[len(PROMPTS)] > 0  # the rows ran together
    for p, res, ref in zip(PROMPTS, results, refs):
        assert res.tokens == ref, f"prompt {p}: first difference at {first_diff(res.tokens, ref)}"
        assert res.stats.drafter == "script"
    assert results[0].stats.accepted >= 10 and results[0].stats.rejected >= 3, results[0].stats


@pytest.mark.parametrize("family_bundle", ["llama"], indirect=True)
def test_queue_overflow_raises_the_typed_error(family_bundle):
    out = family_bundle[3]
    with BatchEngine(out, max_batch=1, max_queue=2) as engine:
        running = engine.submit(PROMPTS[0], max_new_tokens=170, ignore_eos=True)
        deadline = time.monotonic() + 30
        while engine.active == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        five = SamplingParams(max_new_tokens=5)
        with pytest.raises(InputError, match="3 requests in one group exceed the queue's 2"):
            engine.submit_together([(PROMPTS[1], five)] * 3)  # never queueable whole: the request's fault (a 400), not a retry
        with pytest.raises(InputError):
            engine.submit_together([(PROMPTS[1], five), ([], five)])  # one bad request in the group
        queued = engine.submit_together([(PROMPTS[1], five)] * 2)  # room for two: neither group above left any
        with pytest.raises(QueueFullError, match="retry later"):
            engine.submit_together([(PROMPTS[1], five)])  # a group that fits the queue, but not now
        with pytest.raises(QueueFullError, match="retry later"):
            engine.submit(PROMPTS[1], max_new_tokens=5)
        running.cancel()
        assert all(h.result(timeout=60).stats.finish_reason in ("eos", "length") for h in queued)  # the queue drains
    with pytest.raises(QueueFullError, match="closed"):
        engine.submit(PROMPTS[1])


def test_engine_refuses_more_rows_than_the_bundle_has(llama_bundle):
    with pytest.raises(ConfigError, match="--max-batch"):
        BatchEngine(llama_bundle[2], max_batch=2)  # exported without batched graphs


def test_a_handle_is_read_from_asyncio_and_a_closed_loop_does_not_stop_the_engine(llama_bundle):
    """``async for`` over a handle gives the same tokens as ``result()`` while the event loop
    keeps running other tasks; a reader whose loop closes mid-request (its pushes then have
    nowhere to go) leaves the engine serving the next request."""
    import asyncio

    with BatchEngine(llama_bundle[2], max_queue=4) as engine:

        async def read(h, stop_after=None):
            ticks, pieces = 0, []

            async def ticker():
                nonlocal ticks
                while not h.done.is_set():
                    ticks += 1
                    await asyncio.sleep(0)

            t = asyncio.create_task(ticker())
            async for piece in h:
                pieces.append(piece)
                if stop_after and len(pieces) == stop_after:
                    break
            t.cancel()
            return pieces, ticks

        h = engine.submit([5, 6, 7], max_new_tokens=60, ignore_eos=True)
        pieces, ticks = asyncio.run(read(h))
        assert [t for p in pieces for t in p.tokens] == h.result().tokens and len(h.tokens) == 60
        assert ticks > len(pieces)  # the loop ran other work while waiting
        assert "".join(p.text for p in pieces) == h.result().text

        h = engine.submit([5, 6, 7], max_new_tokens=100, ignore_eos=True)
        asyncio.run(read(h, stop_after=1))  # the loop is closed while the engine still pushes
        assert len(h.result(timeout=60).tokens) == 100 and engine.alive
        assert len(engine.submit([8, 9], max_new_tokens=10, ignore_eos=True).result(timeout=60).tokens) == 10


@pytest.mark.parametrize("family_bundle", ["llama"], indirect=True)
def test_greedy_rows_beside_sampled_rows_in_fused_calls(family_bundle):
    """Greedy and sampled rows share the fused sampling graph's calls; the greedy rows are still
    the target's argmax, token for token."""
    family, target, _, out, _ = family_bundle
    model = load_model(target)
    refs = [torch_greedy(model, p, 40) for p in PROMPTS]
    with BatchEngine(out) as engine:
        assert engine.engine.draft.fused_runners, "the llama bundle has fused draft graphs"
        with all_queued(engine):
            greedy = [engine.submit(p, max_new_tokens=40, ignore_eos=True) for p in PROMPTS]
            sampled = [engine.submit(PROMPTS[0], max_new_tokens=40, temperature=1.0, top_p=0.9, seed=s, ignore_eos=True) for s in range(3)]
        results = [h.result(timeout=120) for h in greedy]
        assert all(len(h.result(timeout=120).tokens) == 40 for h in sampled)
        assert engine.occupancy[4] > 0
    for p, res, ref in zip(PROMPTS, results, refs):
        assert res.tokens == ref, f"prompt {p}: first difference at {first_diff(res.tokens, ref)}"


def test_per_size_batch_graphs_still_decode_exactly(llama_bundle, tmp_path, monkeypatch):
    """``--batch-graphs per-size`` (one graph and session per row count, as bundles before the
    rows graph; what a captured batch runs on a GPU): the engine opens the batch-1 and 2-row graphs
    and each row keeps the target's greedy output, through the captured runners too."""
    from specdec.engines.executor import graph_names
    from specdec.export.pipeline import ExportConfig, export_bundle

    target, draft, _ = llama_bundle
    out = tmp_path / "per-size"
    m = export_bundle(ExportConfig(str(target), str(draft), out, gamma=4, max_seq_len=128, max_batch=2, batch_graphs="per-size"))
    assert m.rows_graph("target") is None and m.batch_sizes() == (2,)
    assert graph_names(m, ["target", "draft"], 2, fused=False) == ["target_dynamic", "target_batch2", "draft_dynamic", "draft_batch2"]
    model = load_model(target)
    requests = [(PROMPTS[0], 30, 4), (PROMPTS[1], 20, 2), ([77], 25, "auto")]
    with BatchEngine(out) as engine:
        with all_queued(engine):
            handles = [engine.submit(p, max_new_tokens=n, gamma=g, ignore_eos=True) for p, n, g in requests]
        results = [h.result(timeout=120) for h in handles]
        assert engine.occupancy[2] > 0  # the 2-row graph ran
    for (prompt, n, _), res in zip(requests, results):
        assert res.tokens == torch_greedy(model, prompt, n)
    # Provider cuda-graph's batched runners (engines/captured.py CapturedBatchRunner: a graph per
    # call length and slot arrangement, inputs in device buffers, each row's total bound once at the
    # cache length), on the CPU provider with the KV in OrtValues, where nothing is captured: the
    # same tokens, so on a GPU a difference is the capture's.
    from specdec.engines import sessions as ort_sessions
    from specdec.engines.captured import CapturedBatchRunner

    monkeypatch.setitem(ort_sessions.DEVICE, "cpu", "ortvalue")
    monkeypatch.setattr("specdec.engines.executor.CAPTURE", {"cpu"})
    with BatchEngine(out) as engine:
        with all_queued(engine):
            handles = [engine.submit(p, max_new_tokens=n, gamma=g, ignore_eos=True) for p, n, g in requests]
        assert [h.result(timeout=120).tokens for h in handles] == [r.tokens for r in results]
        runner = engine.engine.target.batched[2]
        assert isinstance(runner, CapturedBatchRunner) and runner.graphs and not runner.uncaptured, "the 2-row calls ran on captured runners"
    with pytest.raises(ConfigError, match="--batch-graphs 'some'"):
        ExportConfig(str(target), str(draft), out, max_batch=2, batch_graphs="some")


@pytest.mark.parametrize("family_bundle", ["llama"], indirect=True)
@pytest.mark.parametrize("drafter", ["model", "hierarchical"])
def test_choices_of_one_prompt_share_its_prefill(family_bundle, drafter):
    """Four rows of one prompt (3 prefill chunks) submitted together feed it once: the other
    three copy its KV rows and prompt logprobs. Each row's output is what it gives alone:
    greedy, the target's argmax loop; seeded and sampled, the same tokens and logprobs."""
    family, target, _, out, _ = family_bundle
    prompt = [(5 * i) % 290 + 4 for i in range(2 * PREFILL_CHUNK + 9)]
    kw = dict(max_new_tokens=24, ignore_eos=True, logprobs=1, prompt_logprobs=2, gamma=3)
    with BatchEngine(out, drafter=drafter) as engine:
        for sampled in (False, True):
            settings = [dict(temperature=1.0, seed=40 + j) if sampled else dict(temperature=0) for j in range(4)]
            before = engine.engine.shared_tokens
            together = [h.result(timeout=300) for h in engine.submit_together([(prompt, SamplingParams(**kw, **s)) for s in settings])]
            assert engine.engine.shared_tokens - before == 3 * (len(prompt) - 1)  # fed once, copied three times
            alone = [engine.submit(prompt, **kw, **s).result(timeout=300) for s in settings]
            for a, b in zip(together, alone):
                assert a.tokens == b.tokens
                # a row in a 4-row call and alone: two bodies of the rows graph, equal to 1e-4 (the export's bound)
                assert [x.token for x in a.logprobs] == [x.token for x in b.logprobs]
                assert np.allclose([x.logprob for x in a.logprobs], [x.logprob for x in b.logprobs], atol=1e-4, rtol=0)
                assert a.prompt_logprobs == b.prompt_logprobs and len(a.prompt_logprobs) == len(prompt)  # the same 1-row calls, copied
            if not sampled:
                assert together[0].tokens == torch_greedy(load_model(target), prompt, 24)
            else:
                assert len({tuple(r.tokens) for r in together}) > 1  # the rows draw from their own seeds

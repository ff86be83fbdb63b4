"""Encoder-decoder bundles (T5, BART, Marian), end to end: the output is the target's.

Greedy: token for token against a PyTorch argmax loop (the HF model's encoder run once, its
decoder stepped over HF's cache), for every drafter, several γ and sources, long enough to
cross many rejections and fully accepted calls. Sampling: the first two tokens' marginals
over thousands of seeded runs against the target's exact distribution (chi-square, as for the
decoder-only bundles in test_decoder_exact.py). Bad input: typed one-line errors.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("scipy.stats")

from models import load_seq2seq, seq2seq_greedy  # noqa: E402
from test_decoder_exact import check_first_two, chi_square_p, first_diff, runs_for_power  # noqa: E402

from specdec.errors import ConfigError, InputError  # noqa: E402
from specdec.runtime import SamplingConfig, SpeculativeDecoder, standardize  # noqa: E402

# Sources: random ids, a repetitive one (prompt lookup finds copies in it), a short one.
SOURCES = [[5, 17, 42, 99, 7, 3, 250, 61, 1], [30, 31, 32, 33, 34, 30, 31, 32, 33, 34, 30, 31, 32, 1], [200, 1]]
NEW = 100


load, torch_greedy = load_seq2seq, seq2seq_greedy


def test_bundle_has_encoders_and_cross_inputs(seq2seq_bundle):
    family, _, _, out, m = seq2seq_bundle
    assert m.seq2seq and m.max_source_len == 64 and m.decoder_start_token_id == 2
    for model in ("target", "draft"):
        _, enc = m.graph(model, "encoder")
        _, dyn = m.graph(model, "dynamic")
        layers = getattr(m, model).num_layers
        assert len(enc.io.cross) == layers and dyn.io.cross == enc.io.cross  # the decoder reads what the encoder writes
        assert m.validation[model]["logits"] < 1e-4 and m.validation[model]["top1_agreement"] == 1.0


@pytest.mark.parametrize("drafter", ["model", "lookup", "ngram", "hierarchical"])
def test_greedy_matches_pytorch(seq2seq_bundle, drafter):
    family, target, _, out, _ = seq2seq_bundle
    model = load(target)
    dec = SpeculativeDecoder.load(out, drafter=drafter)
    full = rejected = 0
    for source in SOURCES:
        ref = torch_greedy(model, source, NEW)
        for gamma in (0, 1, 2, 4) if drafter == "model" else (4,):
            res = dec.generate(source, max_new_tokens=NEW, gamma=gamma, ignore_eos=True)
            assert res.tokens == ref, f"{family} {drafter} gamma={gamma} source={source}: first difference at {first_diff(res.tokens, ref)}"
            s = res.stats
            if gamma:
                full += s.accepted_at[gamma - 1]
                rejected += s.verify_calls - s.accepted_at[gamma - 1]
    if drafter == "model":  # the run must cross both rollback paths many times, or it proved little
        assert rejected >= 20 and full >= 20, f"{family}: {rejected} rejecting and {full} fully accepted calls"


def test_source_as_text_and_a_decoder_prefix(seq2seq_bundle):
    family, target, _, out, _ = seq2seq_bundle
    dec = SpeculativeDecoder.load(out)
    text = "def add(a, b):\n    return a + b\n"
    ids = dec.codec.encode(text)
    assert dec.generate(text, max_new_tokens=12, ignore_eos=True).tokens == dec.generate(ids, max_new_tokens=12, ignore_eos=True).tokens
    # source= with a prompt: the prompt continues after the decoder start token
    full = torch_greedy(load(target), ids, 12)
    res = dec.generate(full[:3], source=ids, max_new_tokens=9, ignore_eos=True)
    assert res.tokens == full[3:]


def exact_first_two(model, source: list[int], cfg: SamplingConfig) -> tuple[np.ndarray, np.ndarray]:
    """P(t1) and P(t2) = Σ_t1 P(t1) P(t2 | t1) of the target itself under ``cfg``."""
    start = model.config.decoder_start_token_id
    with torch.no_grad():
        src = torch.tensor([source])
        p1 = standardize(model(input_ids=src, decoder_input_ids=torch.tensor([[start]])).logits[0, -1].double().numpy(), cfg)
        support = np.flatnonzero(p1)
        dec_ids = torch.tensor([[start, int(t)] for t in support])
        p2 = standardize(model(input_ids=src.expand(len(support), -1), decoder_input_ids=dec_ids).logits[:, -1].double().numpy(), cfg)
    return p1, p1[support] @ p2


SAMPLING = {"plain": dict(temperature=1.0), "temperature+top_k": dict(temperature=0.7, top_k=20), "top_p": dict(temperature=1.0, top_p=0.9)}


@pytest.mark.parametrize("mode", list(SAMPLING))
def test_first_two_tokens_follow_the_target(seq2seq_bundle, mode):
    family, target, draft, out, m = seq2seq_bundle
    if family != "t5" and mode != "plain":
        pytest.skip("filtered sampling is the same NumPy code for every family: checked on T5")
    kw = SAMPLING[mode]
    cfg = SamplingConfig(kw["temperature"], kw.get("top_k"), kw.get("top_p"))
    source = SOURCES[0]
    p1, p2 = exact_first_two(load(target), source, cfg)
    q1, q2 = exact_first_two(load(draft), source, cfg)
    dec = SpeculativeDecoder.load(out)
    runs = runs_for_power(p1, q1)
    results = [dec.generate(source, max_new_tokens=5, seed=seed, ignore_eos=True, **kw) for seed in range(runs)]
    counts = check_first_two(results, p1, p2, (0.1, 0.95), f"{family} {mode}")
    for i, (p, q) in enumerate(((p1, q1), (p2, q2))):
        if np.abs(p - q).sum() > 0.2:  # power, where the draft differs enough to tell apart in these runs
            assert chi_square_p(counts[i], np.where(q > 0, q, 0) + 1e-12) < 1e-6, f"{family} token {i + 1}: test has no power"


def test_lookup_copies_from_the_source(seq2seq_bundle):
    """A source the output repeats: prompt lookup proposes from the source, and is accepted."""
    family, target, _, out, _ = seq2seq_bundle
    model = load(target)
    ref = torch_greedy(model, SOURCES[0], 30)
    source = ref + ref  # the target's own output, twice: copying it pays
    dec = SpeculativeDecoder.load(out, drafter="lookup")
    res = dec.generate(source, max_new_tokens=40, ignore_eos=True)
    assert res.tokens == torch_greedy(model, source, 40)
    assert res.stats.drafted > 0, f"{family}: lookup proposed nothing from a source the output could copy"


def test_bad_input_is_refused(seq2seq_bundle, llama_bundle):
    _, _, _, out, m = seq2seq_bundle
    dec = SpeculativeDecoder.load(out)
    with pytest.raises(InputError, match="source of 65 tokens exceeds the bundle's max-source-len 64"):
        dec.generate([5] * 65)
    with pytest.raises(InputError, match="source is missing"):
        dec.generate(source=None, max_new_tokens=4)
    with pytest.raises(InputError, match=r"source token id 999 is outside the vocabulary \[0, 320\)"):
        dec.generate([5, 999])
    from specdec.runtime.batch import BatchEngine

    with pytest.raises(ConfigError, match="max_batch=5.*expected 1..4 rows"):
        BatchEngine(out, max_batch=5)  # the bundle's rows graph holds 4
    decoder_only = SpeculativeDecoder.load(llama_bundle[2])
    with pytest.raises(InputError, match="decoder-only and takes a prompt, not a source"):
        decoder_only.generate([5, 6], source=[7, 8])


@pytest.mark.parametrize("drafter", ["model", "hierarchical", "lookup", "ngram"])
def test_batch_engine_serves_encoder_decoder_bundles(seq2seq_bundle, drafter):
    """BatchEngine over the bundle's rows graphs: 8 requests submitted at once, decoded 4 rows
    to a call (each row over its own source, its own γ), each the target's greedy output token
    for token."""
    from specdec.runtime.batch import BatchEngine

    family, target, _, out, _ = seq2seq_bundle
    model = load(target)
    sources = [SOURCES[i % len(SOURCES)][: 9 - i % 4] + [1] for i in range(8)]
    with BatchEngine(out, drafter=drafter, max_queue=8) as engine:
        handles = [engine.submit(src, max_new_tokens=40, gamma=(0, 2, 4, "auto")[i % 4], ignore_eos=True) for i, src in enumerate(sources)]
        results = [h.result(timeout=300) for h in handles]
        together = max(engine.occupancy)
    drafted = 0
    for src, res in zip(sources, results):
        ref = torch_greedy(model, src, 40)
        assert res.tokens == ref, f"{family} {drafter} source={src}: first difference at {first_diff(res.tokens, ref)}"
        drafted += res.stats.drafted
    assert drafted > 0
    assert together == 4, f"{family} {drafter}: at most {together} rows decoded together"


def test_batch_engine_samples_encoder_decoder_as_the_target(seq2seq_bundle):
    """Seeded sampled requests through BatchEngine: first-two-token marginals against the target's."""
    from specdec.runtime.batch import BatchEngine

    family, target, _, out, m = seq2seq_bundle
    if family != "t5":
        pytest.skip("the batched path is the same code for every family: checked on T5")
    runs, source = 3000, SOURCES[0]
    p1, p2 = exact_first_two(load(target), source, SamplingConfig(1.0))
    with BatchEngine(out, max_queue=runs) as engine:
        handles = [engine.submit(source, max_new_tokens=5, temperature=1.0, seed=seed, ignore_eos=True) for seed in range(runs)]
        results = [h.result(timeout=600) for h in handles]
    check_first_two(results, p1, p2, (0.1, 0.95), f"{family} batched")


def test_cli_generate_with_a_source(seq2seq_bundle, llama_bundle):
    """``specdec generate --source-ids`` decodes the target's greedy output; bad input exits 2 with one line."""
    import json

    from test_cli import run

    _, target, _, out, _ = seq2seq_bundle
    res = run("generate", str(out), "--source-ids", ",".join(map(str, SOURCES[0])), "--max-new-tokens", "10", "--ignore-eos", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["tokens"] == torch_greedy(load(target), SOURCES[0], 10)
    for args, message in (
        ((), "give exactly one of --prompt TEXT and --prompt-ids 1,2,3 (an encoder-decoder bundle: --source TEXT"),
        (("--source-ids", ",".join(["5"] * 65)), "exceeds the bundle's max-source-len 64"),
        (("--source", "x", "--source-ids", "5"), "give exactly one of --source TEXT and --source-ids"),
    ):
        res = run("generate", str(out), *args)
        assert res.returncode == 2 and message in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    res = run("generate", str(llama_bundle[2]), "--source-ids", "5,6")
    assert res.returncode == 2 and "decoder-only and takes a prompt, not a source" in res.stderr


def test_one_source_is_encoded_once_for_its_choices_and_kept_in_its_slot(seq2seq_bundle):
    """n choices of one source (``submit_together``, as the server's ``n``) take its cross K/V
    from the first row that encoded it; a slot that holds a source keeps it for the next request
    with the same source. Sampled choices stay each their own seed's draw: equal to the same
    requests submitted one at a time to a fresh engine."""
    from specdec.runtime.batch import BatchEngine
    from specdec.runtime.params import SamplingParams

    family, target, _, out, _ = seq2seq_bundle
    if family != "t5":
        pytest.skip("the engine's source bookkeeping is the same code for every family: checked on T5")
    src = SOURCES[1]
    params = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=seed, ignore_eos=True) for seed in range(4)]
    with BatchEngine(out, max_queue=8) as engine:
        group = [h.result(timeout=300) for h in engine.submit_together([(None, p) for p in params], source=src)]
        encodes = [m.encodes for m in engine.engine.models]
        again = engine.submit(src, max_new_tokens=12, ignore_eos=True).result(timeout=300)
        assert [m.encodes for m in engine.engine.models] == encodes == [1, 1]  # once per model for all 5 requests
    with BatchEngine(out, max_batch=1, max_queue=8) as alone:
        want = [alone.submit(src, p).result(timeout=300).tokens for p in params]
    assert [r.tokens for r in group] == want
    assert again.tokens == torch_greedy(load(target), src, 12)


def test_rows_take_penalties_and_logprobs_as_one_row_does(seq2seq_bundle):
    """The request fields the engine applies per row (repetition and frequency penalties, a logit
    bias, logprobs with their top-k) give the same tokens and log-probs in an 8-row engine over the
    rows graph as one request alone on the batch-1 graphs; the logprobs are PyTorch's
    log-softmax of the target's logits at each kept position (greedy, no penalty: the raw mode).
    Tolerance 1e-4: float32 graphs against PyTorch, as the export's validation allows."""
    from specdec.runtime.batch import BatchEngine

    family, target, _, out, _ = seq2seq_bundle
    if family != "bart":
        pytest.skip("per-row request fields are the same engine code for every family: checked on BART")
    fields = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.5, logit_bias={7: 2.0}), dict(logprobs=3), dict(logprobs=2, gamma=0)]
    sources = [SOURCES[i % len(SOURCES)][: 9 - i % 3] + [1] for i in range(8)]
    dec = SpeculativeDecoder.load(out)
    want = [dec.generate(src, max_new_tokens=24, ignore_eos=True, **fields[i % 4]) for i, src in enumerate(sources)]
    with BatchEngine(out, max_queue=8) as engine:
        got = [h.result(timeout=300) for h in [engine.submit(src, max_new_tokens=24, ignore_eos=True, **fields[i % 4]) for i, src in enumerate(sources)]]
        assert max(engine.occupancy) == 4
    model = load(target)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.tokens == b.tokens, f"request {i} {fields[i % 4]}: first difference at {first_diff(a.tokens, b.tokens)}"
        if a.logprobs is None:
            continue
        assert [lp.token for lp in a.logprobs] == a.tokens and [[t for t, _ in lp.top] for lp in a.logprobs] == [[t for t, _ in lp.top] for lp in b.logprobs]
        with torch.no_grad():
            ref = torch.log_softmax(model(input_ids=torch.tensor([sources[i]]), decoder_input_ids=torch.tensor([[2] + a.tokens[:-1]])).logits[0].double(), -1)
        ours = np.array([lp.logprob for lp in a.logprobs])
        assert np.abs(ours - ref[np.arange(len(a.tokens)), a.tokens].numpy()).max() < 1e-4, f"request {i}"


def test_rows_bundle_encodes_the_sources_admitted_together(seq2seq_bundle):
    """A bundle exported with ``--max-batch 4``: per model a rows graph of 1, 2 and 4 rows and a
    batched encoder (padded, masked), both validated at export. 8 requests of sources of
    different lengths queued as one group, plain (γ = 0: the 4 rows of a wave end together), run
    4 rows a call and encode each wave's 4 sources in one call per model; each request is
    PyTorch's greedy output token for token. A lone source through the batched encoder (B = 1,
    below the B >= 2 it was traced at) gives the batch-1 encoder's K/V."""
    from specdec.runtime.batch import BatchEngine

    family, target, _, out, m = seq2seq_bundle
    if family != "t5":
        pytest.skip("the rows graphs' and the batched encoder's bookkeeping is the same code for every family: checked on T5")
    for model in ("target", "draft"):
        assert m.graphs[f"{model}_rows"].rows == (1, 2, 4) and m.validation[f"{model}_rows"]["top1_agreement"] == 1.0
        assert m.graphs[f"{model}_encoder_rows"].io.mask == "attention_mask"
    from specdec.runtime.params import SamplingParams

    sources = [[5 + i, 17, 42, 99 - i, 7, 3, 250, 61, 1][: 3 + i % 6] for i in range(8)]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, gamma=0)
    with BatchEngine(out, max_queue=8) as engine:  # queued as one group: none starts before all are queued
        results = [h.result(timeout=300) for h in engine.submit_together([(src, params) for src in sources])]
        assert max(engine.occupancy) == 4
        assert [model.encodes for model in engine.engine.models] == [2, 2]  # 8 sources, 4 a call
    model = load(target)
    assert [r.tokens for r in results] == [torch_greedy(model, s, 16) for s in sources]
    one_source_through_both_encoders(out)


def one_source_through_both_encoders(out) -> None:
    """A rows engine runs a lone source through the batched encoder (B = 1, below the B >= 2 it
    was traced at): its K/V are the batch-1 encoder's, to float32 rounding (1e-5: both are the
    same float32 ops over the same weights; only the kernels' shapes differ). Its session runs
    without ONNX Runtime's CPU arena; the batch-1 encoder's keeps it."""
    import numpy as np

    from specdec.engines.kv import CrossKV
    from specdec.engines.ort import BatchEncoder, EncoderRunner
    from specdec.engines.sessions import open_session
    from specdec.manifest import load_manifest

    m = load_manifest(out)
    spec = m.target
    crosses = [CrossKV(spec.num_layers, spec.num_heads, m.max_source_len, spec.head_dim, m.dtype) for _ in range(2)]
    one, rows = m.graph("target", "encoder"), next((n, g) for n, g in m.graphs.items() if g.role == "encoder" and g.model == "target" and g.batch > 1)
    source = np.array([5, 17, 42, 99, 7, 3, 250, 61, 1])
    single, batched = open_session(out, *one), open_session(out, *rows)
    # the batched encoder's calls range from 1 to max-batch padded sources: ORT's arena would keep the largest's activations
    assert not batched.get_session_options().enable_cpu_mem_arena and single.get_session_options().enable_cpu_mem_arena
    EncoderRunner(single, *one, crosses[0]).run(source)
    BatchEncoder(batched, *rows, 4, m.max_source_len).run([source], crosses[1:])
    assert crosses[0].length == crosses[1].length == len(source)
    assert max(float(np.abs(a - b).max()) for a, b in zip(crosses[0].views(), crosses[1].views())) < 1e-5

"""The device-cache code path (what provider="cuda" runs), exercised on the CPU.

On CUDA every KV buffer is an OrtValue bound by pointer, never a NumPy array: slot copies,
row moves and prefix sharing cannot touch it from Python. Device "ortvalue" keeps host memory
the same way, so these tests run that path here, where CI has no GPU; tools/gpu/check.py runs
the same comparisons on a real GPU.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from specdec.engines import sessions as ort_sessions
from specdec.engines.batch import BatchRunner, SlotCache
from specdec.engines.sessions import open_session
from specdec.errors import EngineError
from specdec.manifest import load_manifest
from specdec.runtime import SpeculativeDecoder
from specdec.runtime.batch import BatchEngine

LLAMA = pytest.mark.parametrize("family_bundle", ["llama"], indirect=True)
PROMPTS = [[5, 9, 13, 2, 7], [11, 3, 3, 8], [5, 9, 13, 2, 7, 21, 4], [30, 31, 32]]  # two share a prefix
CHAIN_DRAFTERS = ["model", "model-steps", "hierarchical", "lookup"]


def _decode(bundle, drafter: str, temperature: float) -> list[list[int]]:
    dec = SpeculativeDecoder.load(bundle, drafter=drafter)
    return [dec.generate(p, max_new_tokens=24, ignore_eos=True, temperature=temperature, seed=3).tokens for p in PROMPTS]


def _batch(bundle, drafter: str | None = None) -> list[list[int]]:
    with BatchEngine(bundle, max_batch=4, drafter=drafter) as engine:
        return [r.tokens for r in engine.generate_many(PROMPTS, max_new_tokens=24, ignore_eos=True)]


@LLAMA
def test_device_buffers_decode_as_host_arrays(family_bundle, monkeypatch):
    """Every chain drafter, greedy and sampled with a seed, batch 1 and batched: the same tokens
    with the KV in OrtValues as in NumPy arrays."""
    bundle = family_bundle[3]
    host = {(d, t): _decode(bundle, d, t) for d in CHAIN_DRAFTERS for t in (0.0, 1.0)}
    host_batch = _batch(bundle)
    monkeypatch.setitem(ort_sessions.DEVICE, "cpu", "ortvalue")
    dec = SpeculativeDecoder.load(bundle)
    assert isinstance(dec.engine.target.cache.slot(0).keys[0], ort.OrtValue)  # the path under test runs
    for (drafter, t), want in host.items():
        assert _decode(bundle, drafter, t) == want, (drafter, t)
    assert _batch(bundle) == host_batch


@LLAMA
def test_tree_drafters_on_device_buffers_move_rows_there(family_bundle, monkeypatch):
    """A tree keeps its accepted path's KV rows out of order; on device buffers the bundle's move
    graph (export/kv_move.py) moves them where they are. Greedy and sampled with a seed, the
    tree drafters give the host path's tokens, with rows moved on the device (not only prefixes
    kept); a bundle exported before the move graph refuses a tree on a device cache at load, by
    name, not in the middle of a request."""
    from specdec.engines.executor import Executor, graph_names, open_sessions
    from specdec.engines.threads import ThreadPolicy

    bundle = family_bundle[3]
    host = {t: _decode(bundle, "lookup-tree", t) for t in (0.0, 1.0)}
    host_batch = _batch(bundle, "lookup-tree")
    monkeypatch.setitem(ort_sessions.DEVICE, "cpu", "ortvalue")
    for t, want in host.items():
        assert _decode(bundle, "lookup-tree", t) == want, t
    assert _batch(bundle, "lookup-tree") == host_batch
    dec = SpeculativeDecoder.load(bundle, drafter="lookup-tree")
    for p in PROMPTS:
        dec.generate(p + p[:3], max_new_tokens=24, ignore_eos=True)
    target = dec.engine.target
    assert isinstance(target.slot(0).keys[0], ort.OrtValue) and target.mover.calls > 0, "rows were moved by the graph, on device buffers"
    m = load_manifest(bundle)
    older = dataclasses.replace(m, graphs={n: g for n, g in m.graphs.items() if g.role != "move"})
    sessions = open_sessions(bundle, older, graph_names(older, ["target"], 1, fused=False, tree=True), "cpu", ThreadPolicy.of(None))
    with pytest.raises(EngineError, match="re-export it with --tree-nodes"):
        Executor(bundle, older, "target", sessions, "cpu")


def test_device_kv_buffers_start_zeroed(monkeypatch):
    """Fresh device memory holds whatever was there; CUDA's float16 attention reads cache rows
    past the valid ones, and a NaN there turned greedy output wrong from the first token on
    the H100 (docs/bench/gpu/h100-second-run/diag.json: a cache filled with NaN before each prompt gives wrong
    tokens, zeros or finite garbage the right ones). So every device buffer is zeroed when made."""
    import numpy as np

    from specdec.engines.kv import KVCache

    made = ort.OrtValue.ortvalue_from_shape_and_type

    def garbage(shape, dtype, memory, device_id):  # what fresh device memory may hold
        value = made(shape, dtype, memory, device_id)
        value.update_inplace(np.full(shape, np.nan, dtype=dtype))
        return value

    monkeypatch.setattr(ort.OrtValue, "ortvalue_from_shape_and_type", staticmethod(garbage))
    assert np.isnan(ort.OrtValue.ortvalue_from_shape_and_type([2, 3], np.float16, "cpu", 0).numpy()).all()  # the patch bites
    cache = KVCache(2, 3, 16, 4, "float16", device="ortvalue")
    assert all(not b.numpy().any() for b in (*cache.keys, *cache.values))


def test_stale_memories_follow_where_the_graph_reads_its_inputs():
    """ORT copies a bound input to the device that reads it at bind time: what must be bound
    again before each run depends on where the cache lives and where attention runs."""
    import numpy as np

    from specdec.engines.binding import stale_memories

    assert stale_memories("cpu", np.float32) == frozenset()  # a host buffer is read in place
    assert stale_memories("cuda", np.float16) == {"cpu"}  # host token buffers; the KV stays put
    assert stale_memories("cuda", np.float32) == {"cpu", "cuda"}  # float32 attention runs on the CPU provider


@LLAMA
def test_device_runners_bind_their_host_inputs_again_before_each_run(family_bundle, monkeypatch):
    """The first GPU run decoded from token ids copied once, at bind time (docs/gpu.md): on a
    device cache every runner re-binds its host inputs before each run; on the CPU none does."""
    bundle = family_bundle[3]
    host = SpeculativeDecoder.load(bundle).engine.target.static
    assert host.binding.inputs == {}
    monkeypatch.setitem(ort_sessions.DEVICE, "cpu", "ortvalue")
    device = SpeculativeDecoder.load(bundle).engine
    io = device.target.static.io_names
    assert {io.ids, io.positions, io.seqlens, io.total} <= set(device.target.static.binding.inputs)
    fused = next(iter(device.draft.fused_runners.values()))
    assert {fused.io.ids, fused.io.positions, fused.io.seqlens} <= set(fused.binding.inputs)
    with BatchEngine(bundle, max_batch=4) as engine:
        engine.generate_many(PROMPTS, max_new_tokens=4)
        runner = next(iter(engine.engine.target.batched.values()))
        ran = [b for b, s in runner.bound_tokens.items() if s]  # bodies bind their token buffers at their first run
        assert ran and all({runner.io.ids, runner.io.positions, runner.io.seqlens} <= set(runner.bindings[b].inputs) for b in ran)


def _rows_gqas(proto: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Every GroupQueryAttention of a rows graph (export/rows.py: each body inside an If)."""
    found = []
    for node in proto.graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                found += [n for n in a.g.node if n.op_type == "GroupQueryAttention"]
    return found


@LLAMA
def test_batched_attention_reads_its_rows_total_from_an_input(family_bundle):
    """CUDA's GroupQueryAttention read a total length computed inside the graph wrong: the H100's
    third run decoded a constant token through every batched graph, and one GQA fed its total
    as an input matched the CPU (docs/gpu.md). Every GQA of a batched graph, target and draft,
    takes its own row's total straight from a graph input."""
    bundle = family_bundle[3]
    m = load_manifest(bundle, "size")
    for model in ("target", "draft"):
        name, spec = m.rows_graph(model)
        assert spec.io.totals == tuple(f"total_sequence_length_{b}" for b in range(spec.batch))
        proto = onnx.load(str(bundle / spec.file), load_external_data=False)
        inputs = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim] for i in proto.graph.input}
        assert all(inputs[t] == [] for t in spec.io.totals), inputs  # a scalar per row, as the runner binds it
        gqas = _rows_gqas(proto)
        assert len(gqas) == sum(spec.rows) * getattr(m, model).num_layers
        for n in gqas:  # row b's attention (past_key_<layer>_<b>) reads total_sequence_length_<b>
            assert n.input[6] == f"total_sequence_length_{n.input[3].rsplit('_', 1)[1]}", list(n.input)


@LLAMA
def test_a_batched_graph_without_row_totals_is_refused_on_a_device_cache(family_bundle):
    """A bundle exported before the fix computes its totals in the graph: on a device cache its
    batched engine is refused at load, naming the fix, rather than decoding wrong tokens."""
    bundle = family_bundle[3]
    m = load_manifest(bundle, "size")
    name, spec = m.rows_graph("target")
    older = dataclasses.replace(spec, io=dataclasses.replace(spec.io, totals=()))
    t = m.target
    session = open_session(bundle, name, spec)
    host = SlotCache(t.num_layers, t.num_kv_heads, m.max_seq_len, t.head_dim, m.dtype, spec.batch)
    BatchRunner(session, name, older, host, m.k)  # the CPU reads the graph as it is
    device = SlotCache(t.num_layers, t.num_kv_heads, m.max_seq_len, t.head_dim, m.dtype, spec.batch, "ortvalue")
    with pytest.raises(EngineError, match="re-export the bundle"):
        BatchRunner(session, name, older, device, m.k)


@LLAMA
def test_captured_runners_decode_as_host_arrays(family_bundle, monkeypatch):
    """Provider "cuda-graph"'s runners (engines/captured.py: every input in a buffer of its own
    at a fixed address, the attention total bound once at the cache length, one graph per cache)
    run here on the CPU provider, where nothing is captured: every chain drafter, greedy and
    sampled, batch 1, a fork and BatchEngine's batch-1 calls over several slots give the host
    path's tokens, so on a GPU a difference is the capture's."""
    from specdec.engines.captured import CapturedRunner

    bundle = family_bundle[3]
    host = {(d, t): _decode(bundle, d, t) for d in CHAIN_DRAFTERS for t in (0.0, 1.0)}
    host_ar = _decode(bundle, "lookup", 0.0)
    with BatchEngine(bundle, max_batch=1, cache_slots=3) as engine:
        host_batch = [r.tokens for r in engine.generate_many(PROMPTS, max_new_tokens=24, ignore_eos=True)]
    monkeypatch.setitem(ort_sessions.DEVICE, "cpu", "ortvalue")
    monkeypatch.setattr("specdec.engines.executor.CAPTURE", {"cpu"})  # the runners of "cuda-graph", on the CPU provider
    dec = SpeculativeDecoder.load(bundle)
    target = dec.engine.target
    for (drafter, t), want in host.items():
        assert _decode(bundle, drafter, t) == want, (drafter, t)
    ar = [dec.generate(p, max_new_tokens=24, ignore_eos=True, gamma=0).tokens for p in PROMPTS]
    assert ar == host_ar and isinstance(target.captured[1], CapturedRunner) and len(target.captured[1].graphs) == 1  # one cache
    fork = dec.fork("lookup")
    small = [fork.generate(p, max_new_tokens=24, ignore_eos=True, gamma=g).tokens for p in PROMPTS for g in (2, "auto")]
    assert small == [a for a in host_ar for _ in (2, "auto")]  # greedy: the target's tokens at any γ
    assert 3 in fork.engine.target.captured  # γ = 2's verify of 3 tokens: a captured runner of its own
    with BatchEngine(bundle, max_batch=1, cache_slots=3) as engine:
        assert [r.tokens for r in engine.generate_many(PROMPTS, max_new_tokens=24, ignore_eos=True)] == host_batch
        assert max(len(r.graphs) for r in engine.engine.target.captured.values()) > 1  # slots of their own: a graph each


@LLAMA
def test_the_draft_on_another_device_than_the_target(family_bundle, monkeypatch):
    """``draft_provider``: the target's KV on the device (OrtValues, a provider standing for CUDA),
    the draft model's in host arrays on the CPU provider, as a GPU deployment with its drafter
    on the CPU runs. Every draft-model drafter, greedy and sampled, and BatchEngine give the
    tokens of both on one provider; each model's sessions and caches are where it was placed."""
    monkeypatch.setitem(ort_sessions.PROVIDERS, "device", ort_sessions.PROVIDERS["cpu"])  # the CPU provider, KV kept as on a GPU
    monkeypatch.setitem(ort_sessions.DEVICE, "device", "ortvalue")
    bundle = family_bundle[3]
    drafters = ["model", "model-steps", "hierarchical"]
    host = {(d, t): _decode(bundle, d, t) for d in drafters for t in (0.0, 1.0)}
    host_batch = _batch(bundle)
    for (drafter, t), want in host.items():
        dec = SpeculativeDecoder.load(bundle, drafter=drafter, provider="device", draft_provider="cpu")
        got = [dec.generate(p, max_new_tokens=24, ignore_eos=True, temperature=t, seed=3).tokens for p in PROMPTS]
        assert got == want, (drafter, t)
    engine = dec.engine
    assert isinstance(engine.target.slot(0).keys[0], ort.OrtValue) and isinstance(engine.draft.slot(0).keys[0], np.ndarray)
    assert engine.draft.device == "cpu" and engine.target.device == "ortvalue"
    with BatchEngine(bundle, max_batch=4, provider="device", draft_provider="cpu") as batch:
        assert [r.tokens for r in batch.generate_many(PROMPTS, max_new_tokens=24, ignore_eos=True)] == host_batch
        assert batch.engine.draft.fused(2, True) is not None, "the draft on the CPU runs its fused graphs"

"""BatchRunner: rows of a rows graph (one body per row count) over cache slots, against the batch-1 graph on each slot."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.engines.batch import BatchRunner, SlotCache
from specdec.engines.ort import runner_for
from specdec.engines.sessions import open_session
from specdec.errors import InputError
from specdec.manifest import load_manifest

pytest.importorskip("torch")  # the bundle is exported here


@pytest.mark.parametrize("family_bundle", ["llama"], indirect=True)
def test_rows_in_any_slots_match_the_batch1_graph(family_bundle):
    """3 rows of a 4-row graph (one padding row into the scratch slot), slots out of order,
    feeds of different lengths: each row's logits and KV rows equal the batch-1 dynamic graph's
    on the same slot contents (to 1e-4: the graphs order float operations differently)."""
    out = family_bundle[3]
    m = load_manifest(out)
    t = m.target
    name, spec = m.rows_graph("target")
    cache = SlotCache(t.num_layers, t.num_kv_heads, m.max_seq_len, t.head_dim, m.dtype, 4)
    batched = BatchRunner(open_session(out, name, spec), name, spec, cache, m.k)
    single = runner_for(out, *m.graph("target", "dynamic"), cache.slot(0))
    rng = np.random.default_rng(0)
    prompts = {s: rng.integers(3, 300, size=n) for s, n in ((0, 7), (1, 3), (2, 12))}
    for s, p in prompts.items():  # prompts through the batch-1 graph, slot by slot
        single.bind_cache(cache.slot(s))
        single.run(p)
        cache.slot(s).append(len(p))
    slots, feeds = [2, 0, 1], [rng.integers(3, 300, size=n) for n in (5, 1, 3)]
    before = {s: cache.slot(s).length for s in slots}
    got = batched.run(slots, feeds).copy()  # [3, 5, V]
    assert got.shape == (3, 5, m.vocab_size) and batched.bound_slots[4] == [2, 0, 1, cache.scratch]
    rows_batched = {s: [k[:, :, before[s] : before[s] + len(f)].copy() for k in cache.slot(s).keys] for s, f in zip(slots, feeds)}
    for r, (s, f) in enumerate(zip(slots, feeds)):
        assert cache.slot(s).length == before[s]  # committing is the caller's
        single.bind_cache(cache.slot(s))
        want = single.run(f)
        assert np.abs(got[r, : len(f)] - want).max() < 1e-4, (s, np.abs(got[r, : len(f)] - want).max())
        for k_b, k in zip(rows_batched[s], cache.slot(s).keys):
            assert np.abs(k_b - k[:, :, before[s] : before[s] + len(f)]).max() < 1e-4
    with pytest.raises(InputError, match="1..4 rows"):
        batched.run([0, 1, 2, 3, 0], [np.array([5])] * 5)
    with pytest.raises(InputError, match="exceed max-seq-len"):
        cache.slot(1).append(m.max_seq_len - cache.slot(1).length - 2)
        batched.run([1], [np.array([5, 6, 7])])


@pytest.mark.parametrize("family_bundle", ["llama"], indirect=True)
def test_every_body_matches_the_batch1_graph_as_calls_switch_between_them(family_bundle):
    """Calls of 1, 3, 2, 4, 1 rows run the bodies of 1, 4, 2, 4 and 1 rows of one session (each
    with its own binding; the bodies not taken return empty tensors): every row's logits equal
    the batch-1 graph's on the same slot, to 1e-4."""
    out = family_bundle[3]
    m = load_manifest(out)
    t = m.target
    name, spec = m.rows_graph("target")
    cache = SlotCache(t.num_layers, t.num_kv_heads, m.max_seq_len, t.head_dim, m.dtype, 4)
    rows = BatchRunner(open_session(out, name, spec), name, spec, cache, m.k, single=8)
    single = runner_for(out, *m.graph("target", "dynamic"), cache.slot(0))
    rng = np.random.default_rng(1)
    for s in range(4):
        p = rng.integers(3, 300, size=int(rng.integers(2, 9)))
        cache.slot(s).append(0)
        single.bind_cache(cache.slot(s))
        single.run(p)
        cache.slot(s).append(len(p))
    for n, body in ((1, 1), (3, 4), (2, 2), (4, 4), (1, 1)):
        assert rows.size_for(n) == body
        slots = list(rng.permutation(4)[:n])
        feeds = [rng.integers(3, 300, size=int(rng.integers(1, m.k + 1))) for _ in slots]
        got = rows.run(slots, feeds).copy()
        assert got.shape == (n, max(len(f) for f in feeds), m.vocab_size)
        for r, (s, f) in enumerate(zip(slots, feeds)):
            single.bind_cache(cache.slot(s))
            want = single.run(f)
            assert np.abs(got[r, : len(f)] - want).max() < 1e-4, (n, s)
            cache.slot(s).append(len(f))
    with pytest.raises(InputError, match="1 rows of up to 9 tokens"):  # a lone row feeds up to ``single`` tokens
        rows.run([0], [np.arange(3, 12)])


@pytest.mark.parametrize("family_bundle", ["llama"], indirect=True)
def test_rows_graph_holds_each_weight_once(family_bundle):
    """The rows graph's bodies read one set of top-level initializers (what lets ONNX Runtime pack
    each weight once): no two point at the same bytes of the weights file, every body's If reads
    them from the outer scope, and a batched engine opens that one session per model."""
    import onnx

    from specdec.engines.executor import graph_names

    out = family_bundle[3]
    m = load_manifest(out)
    name, spec = m.rows_graph("target")
    proto = onnx.load(str(out / spec.file), load_external_data=False)
    ranges = [tuple((e.key, e.value) for e in t.external_data) for t in proto.graph.initializer if t.external_data]
    assert len(ranges) == len(set(ranges)) and len(ranges) > 2 * m.target.num_layers
    ifs = [n for n in proto.graph.node if n.op_type == "If"]
    assert len(ifs) == len(spec.rows)  # side by side, never nested
    for node in ifs:
        for attr in node.attribute:
            assert not attr.g.initializer and not any(n.op_type == "If" for n in attr.g.node)
    assert graph_names(m, ["target", "draft"], 4, fused=False) == ["target_rows", "draft_rows"]
    assert graph_names(m, ["target", "draft"], 1, fused=False) == ["target_dynamic", "draft_dynamic"]

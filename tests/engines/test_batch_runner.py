"""BatchRunner: rows of a batched graph over cache slots, against the batch-1 graph on each slot."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.engines.batch import BatchRunner, SlotCache
from specdec.engines.ort import open_session, runner_for
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
    name, spec = m.graph("target", "dynamic", batch=4)
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
    assert got.shape == (3, 5, m.vocab_size) and batched.bound_slots == [2, 0, 1, cache.scratch]
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

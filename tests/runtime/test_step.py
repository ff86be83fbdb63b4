"""The step plan is plain data, testable without a graph; the KV manager's ``keep`` compacts rows in place."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from specdec.engines.batch import SlotCache
from specdec.runtime.step import schedule


def row(slot, length, gamma=4, left=50, ready=False, adaptive=False):
    return SimpleNamespace(slot=slot, length=length, left=left, ready=ready, req=SimpleNamespace(gamma=gamma, adaptive=adaptive))


def test_a_joining_row_feeds_chunks_then_decodes_in_the_step_of_its_last_chunk():
    fed = {0: 0, 1: 64, 2: 0}
    rows = [row(0, 100), row(1, 66, ready=False), row(2, 1)]  # 99 to feed; 1 left to feed; nothing to feed
    plan = schedule(rows, fed.get, 32, lambda rs: 0)
    assert plan.prefill == [(0, 0, 32), (1, 64, 65)]
    assert plan.decode == [(1, 4), (2, 4)]  # row 0 still feeds; 1 fed its last chunk; 2 had none
    whole = schedule(rows, fed.get, None, lambda rs: 0)  # one request alone: the whole prompt at once
    assert whole.prefill == [(0, 0, 99), (1, 64, 65)] and [s for s, _ in whole.decode] == [0, 1, 2]


def test_gamma_is_the_requests_or_the_policys_and_never_past_the_budget():
    asked = []

    def width(rows):
        asked.append([r.slot for r in rows])
        return 3

    rows = [row(0, 5, gamma=4, ready=True), row(1, 5, adaptive=True, ready=True), row(2, 5, gamma=4, left=2, ready=True), row(3, 5, gamma=0, ready=True)]
    plan = schedule(rows, lambda s: 4, 32, width)
    assert plan.decode == [(0, 4), (1, 3), (2, 1), (3, 0)]
    assert asked == [[0, 1, 2, 3]]  # asked once, with every decoding row
    assert schedule(rows[:1], lambda s: 4, 32, width).decode == [(0, 4)] and len(asked) == 1  # no adaptive row: not asked


def test_keep_compacts_accepted_rows_after_the_committed_ones():
    cache = SlotCache(2, 1, 16, 4, "float32", 2)  # the KV manager: no graphs needed
    for buf in (*cache.keys, *cache.values):
        buf[...] = np.arange(16, dtype=np.float32)[None, None, :, None]  # row r holds r
    cache.commit(1, 5)
    cache.keep(1, [6, 9, 10])  # a tree's accepted path: rows 6, 9, 10 -> 5, 6, 7
    assert cache.length(1) == 8
    view = cache.slot(1)
    for buf in (*view.keys, *view.values):
        assert buf[0, 0, :8, 0].tolist() == [0, 1, 2, 3, 4, 6, 9, 10]
    assert cache.slot(0).keys[0][0, 0, 5, 0] == 5  # another slot untouched
    with pytest.raises(ValueError, match="ascending positions"):
        cache.keep(1, [7, 7])

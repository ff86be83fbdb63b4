"""KVCache bounds and O(1) rollback; no bundle needed."""

from __future__ import annotations

import re

import numpy as np
import pytest

from specdec.engines.kv import KVCache
from specdec.errors import EngineError, InputError

LAYERS, HEADS, MAX, DIM = 2, 2, 8, 4


@pytest.fixture
def cache() -> KVCache:
    return KVCache(LAYERS, HEADS, MAX, DIM, "float32")


def numbers(message: str) -> set[int]:
    return {int(x) for x in re.findall(r"-?\d+", message)}


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg, f"not a one-line message: {msg!r}"
    return msg


def test_layout_and_pointers(cache):
    assert cache.length == 0 and cache.max_seq == MAX
    assert len(cache.keys) == len(cache.values) == LAYERS
    for buf in (*cache.keys, *cache.values):
        assert buf.shape == (1, HEADS, MAX, DIM) and buf.dtype == np.float32
        assert not buf.any()
    ptrs = cache.pointers()
    assert ptrs == [(k.ctypes.data, v.ctypes.data) for k, v in zip(cache.keys, cache.values)]
    assert len({p for pair in ptrs for p in pair}) == 2 * LAYERS  # every buffer is its own memory


def test_append_up_to_max_seq_then_refuses(cache):
    cache.append(3)
    cache.append(MAX - 3)
    assert cache.length == MAX
    cache.append(0)  # a call that keeps nothing is fine, even when full
    with pytest.raises(InputError) as e:
        cache.append(1)
    assert isinstance(e.value, ValueError)
    assert {1, MAX} <= numbers(one_line(e))  # the rows asked for and the limit
    assert cache.length == MAX  # a refused append changes nothing


def test_append_past_max_seq_from_empty(cache):
    with pytest.raises(InputError) as e:
        cache.append(MAX + 1)
    assert {MAX + 1, 0, MAX} <= numbers(one_line(e))
    assert cache.length == 0


def test_negative_append_on_empty_cache_raises(cache):
    with pytest.raises(InputError) as e:
        cache.append(-1)
    assert -1 in numbers(one_line(e))
    assert cache.length == 0


def test_negative_append_on_nonempty_cache_raises(cache):
    """append commits rows a call wrote; a negative count is a caller bug, not a rewind."""
    cache.append(5)
    with pytest.raises(InputError) as e:
        cache.append(-1)
    assert -1 in numbers(one_line(e))
    assert cache.length == 5


@pytest.mark.parametrize("target", [6, -1])
def test_rewind_outside_committed_rows_raises(cache, target):
    cache.append(5)
    with pytest.raises(InputError) as e:
        cache.rewind_to(target)
    assert isinstance(e.value, ValueError)
    assert {target, 5} <= numbers(one_line(e))
    assert cache.length == 5


def test_rewind_is_a_length_change_only(cache):
    cache.append(6)
    rng = np.random.default_rng(0)
    for buf in (*cache.keys, *cache.values):
        buf[...] = rng.standard_normal(buf.shape)
    objects = [*cache.keys, *cache.values]
    snapshot = [b.copy() for b in objects]
    ptrs = cache.pointers()
    for n in (6, 4, 0):  # rewinding to the current length is allowed too
        cache.rewind_to(n)
        assert cache.length == n
    assert all(a is b for a, b in zip(objects, [*cache.keys, *cache.values]))
    assert cache.pointers() == ptrs
    for before, after in zip(snapshot, objects):
        np.testing.assert_array_equal(after, before)  # no row was cleared or moved
    cache.append(3)  # committing again after a rewind works from the new length
    assert cache.length == 3


def test_reset(cache):
    cache.append(7)
    cache.keys[0][..., 0, :] = 1.0
    ptrs = cache.pointers()
    cache.reset()
    assert cache.length == 0
    assert cache.pointers() == ptrs
    assert cache.keys[0][0, 0, 0, 0] == 1.0  # reset forgets rows, it does not clear them
    cache.append(MAX)  # the whole capacity is available again
    assert cache.length == MAX


@pytest.mark.parametrize("dtype, np_dtype", [("float16", np.float16), ("float32", np.float32)])
def test_dtype(dtype, np_dtype):
    c = KVCache(1, 1, 4, 2, dtype)
    assert c.dtype == np_dtype and c.keys[0].dtype == np_dtype


def test_unknown_device_raises():
    with pytest.raises(EngineError) as e:
        KVCache(LAYERS, HEADS, MAX, DIM, "float32", device="tpu")
    assert "tpu" in one_line(e) and "cpu" in str(e.value)


def test_keep_moves_a_tree_path_into_place(cache):
    """keep(): a tree call wrote 6 node rows after 3 committed ones; the accepted path's rows
    (nodes 1, 3, 4) become rows 3, 4, 5, every layer, keys and values; rows before stay."""
    for i, (k, v) in enumerate(zip(cache.keys, cache.values)):
        k[...] = np.arange(cache.max_seq)[None, None, :, None] + 1000 * i  # row r of layer i holds r + 1000 i
        v[...] = -k
    cache.append(3)
    cache.keep([1, 3, 4])
    assert cache.length == 6
    for i, (k, v) in enumerate(zip(cache.keys, cache.values)):
        np.testing.assert_array_equal(k[0, 0, :6, 0], np.array([0, 1, 2, 4, 6, 7]) + 1000 * i)
        np.testing.assert_array_equal(v[0, 0, :6, 0], -(np.array([0, 1, 2, 4, 6, 7]) + 1000 * i))
    cache.keep([0, 1])  # a prefix: nothing moves
    assert cache.length == 8 and cache.keys[0][0, 0, 6, 0] == 6


@pytest.mark.parametrize("rows", [[2, 1], [0, 0], [-1], [10_000]])
def test_keep_refuses_rows_out_of_order_or_range(cache, rows):
    cache.append(2)
    with pytest.raises(InputError, match=re.escape(f"keep({rows})")):
        cache.keep(rows)
    assert cache.length == 2

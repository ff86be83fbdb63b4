"""Batched graph runs: many requests' rows in one ONNX Runtime call, each over its own cache slot.

``SlotCache`` holds the KV cache of ``slots`` requests plus one scratch slot: per layer a key
and a value buffer [slots + 1, kvH, MAX, D], allocated once. Slot s is a ``KVCache`` view over
its block, with its own committed length, so the batch-1 runners (prompts, one request alone)
run over a slot unchanged after ``GraphRunner.bind_cache``.

``BatchRunner`` runs one batched graph over the slot cache: a rows graph (``export/rows.py``:
every row count B of its bodies in one session, so the weights are packed once) or an older
bundle's graph of one fixed B. Row r of a call feeds its tokens at its slot's committed length
and writes their KV rows there in place; rows a call does not use point at the scratch slot.
A call of n rows runs the smallest body B >= n. Row buffers are rebound only when the slot a
row serves changes, token-sized buffers only when S changes (each body has its own binding).
An encoder-decoder's rows graph (export/seq2seq.py) also reads each row's source: the cross K/V
its slot's encoder call wrote (``cross``, one ``CrossKV`` per slot), bound by pointer and
rebound only when the row's slot or that slot's source length changes: never copied per call.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnxruntime as ort

from specdec.engines.binding import Binding, stale_memories
from specdec.engines.kv import NP_DTYPES, CrossKV, KVCache
from specdec.errors import EngineError, InputError, SignatureError
from specdec.manifest import GraphSpec, body_output


class SlotCache:
    """Per layer keys/values [slots + 1, kvH, MAX, D]; ``slot(s)`` is a KVCache view of slot s."""

    def __init__(self, layers: int, kv_heads: int, max_seq: int, head_dim: int, dtype: str, slots: int, device: str = "cpu"):
        if device == "cpu":
            shape = (slots + 1, kv_heads, max_seq, head_dim)
            self.keys = [np.zeros(shape, dtype=NP_DTYPES[dtype]) for _ in range(layers)]  # [slots+1, kvH, MAX, D]
            self.values = [np.zeros(shape, dtype=NP_DTYPES[dtype]) for _ in range(layers)]
            self.views = [KVCache.over([k[s : s + 1] for k in self.keys], [v[s : s + 1] for v in self.values]) for s in range(slots + 1)]
        else:  # device buffers per slot: the graphs bind every row's KV by pointer, contiguous or not
            self.views = [KVCache(layers, kv_heads, max_seq, head_dim, dtype, device) for _ in range(slots + 1)]
        self.scratch = slots  # the slot unused rows of a batched call write into (never read)
        self.max_seq = max_seq

    def slot(self, s: int) -> KVCache:
        return self.views[s]

    # The KV manager: what a step does to a slot's committed rows.

    def length(self, s: int) -> int:
        return self.views[s].length

    def commit(self, s: int, n: int) -> None:
        """Keep the next ``n`` rows the last call wrote in slot ``s``."""
        self.views[s].append(n)

    def rewind_to(self, s: int, n: int) -> None:
        """Forget slot ``s``'s rows from ``n`` on; O(1)."""
        self.views[s].rewind_to(n)

    def copy(self, src: int, dst: int, stop: int) -> bool:
        """Slot ``dst`` takes slot ``src``'s rows [length(dst), stop) and commits them (a prompt
        both slots share, fed once). False, with nothing done, where the buffers are not host
        arrays (a CUDA cache: the caller feeds the rows instead)."""
        start = self.views[dst].length
        if not hasattr(self, "keys") or stop > self.views[src].length or start > stop:
            return False
        for buf in (*self.keys, *self.values):
            buf[dst, :, start:stop] = buf[src, :, start:stop]  # [kvH, stop - start, D]
        self.views[dst].append(stop - start)
        return True

    def keep(self, s: int, rows: Sequence[int]) -> None:
        """Commit the uncommitted rows ``rows`` (absolute positions, ascending, each at or past the
        committed length) of slot ``s``, moved in place to follow the committed ones: how a
        verified tree's accepted path is compacted (``KVCache.keep``). Host caches only."""
        view = self.views[s]
        if any(r < view.length for r in rows):
            raise InputError(f"keep rows {list(rows)}: expected ascending positions in [{view.length}, {view.max_seq})")
        view.keep([r - view.length for r in rows])


def slot_sources(layers: int, heads: int, max_source: int, head_dim: int, dtype: str, slots: int) -> list[CrossKV]:
    """An encoder-decoder's cross K/V per slot, the scratch slot's last: a source of one zero
    row, so the rows a call does not use read a well-formed [1, H, 1, D] (never kept)."""
    sources = [CrossKV(layers, heads, max_source, head_dim, dtype) for _ in range(slots + 1)]
    sources[-1].length = 1
    return sources


class BatchRunner:
    """Run one batched graph of a bundle over a ``SlotCache``.

    ``run(slots, feeds)`` feeds row r the tokens ``feeds[r]`` at slot ``slots[r]``'s committed
    length and returns logits [len(slots), S, V] (S = the longest feed; a shorter feed is padded
    with its last token, and rows and logits past its length are never kept). The returned array
    is a view of a buffer the next call overwrites. Committing is left to the caller.
    ``max_tokens``: the most tokens a row feeds in a call of several rows; ``single``: in a call
    of one row (a prompt chunk), when the graph has a 1-row body.
    """

    def __init__(self, session: ort.InferenceSession, name: str, spec: GraphSpec, cache: SlotCache, max_tokens: int, single: int = 0,
                 cross: Sequence[CrossKV] | None = None):  # fmt: skip
        """``cross``: an encoder-decoder graph's per-slot cross K/V, the scratch slot's last."""
        self.name, self.spec, self.cache, self.session, self.io = name, spec, cache, session, spec.io
        if bool(spec.io.cross) != (cross is not None) or (cross is not None and len(cross) != len(cache.views)):
            raise SignatureError(f"graph {name} reads {len(spec.io.cross)} cross K/V pairs; the runner was given "
                                 f"{'none' if cross is None else len(cross)} sources for {len(cache.views)} slots")  # fmt: skip
        self.cross = cross
        self.rows, self.max_tokens = spec.batch, max_tokens  # rows bound (the largest B), and the most tokens a row feeds per call
        self.sizes = spec.rows or (spec.batch,)  # the B a call may run, ascending
        # a rows graph's body of B rows returns its own outputs (export/rows.py); an older graph has one B
        self.out = (lambda name, b: body_output(name, b, spec.batch)) if spec.rows else (lambda name, b: name)
        specs = {t.name: t for t in (*spec.inputs, *spec.outputs)}
        layers = len(cache.views[0].keys)
        if len(spec.io.past) != self.rows * layers or tuple(specs[spec.io.past[0][0]].shape) != cache.views[0].shape:
            raise SignatureError(f"graph {name} takes {len(spec.io.past)} KV pairs of {list(specs[spec.io.past[0][0]].shape)}, "
                                 f"the slot cache holds {layers} layers of {list(cache.views[0].shape)}; rebuild it from the manifest")  # fmt: skip
        vocab = specs[spec.io.logits].shape[-1]
        self.single = max(single, max_tokens) if self.sizes[0] == 1 else 0
        cap = max(self.rows * max_tokens, self.single)  # tokens per call, over every row
        self._ids = np.zeros((cap,), dtype=np.int64)  # [B * S] viewed as [B, S] per call
        self._pos = np.zeros((cap,), dtype=np.int64)
        self._logits = np.zeros((cap * vocab,), dtype=np.float32)  # [B * S * V]
        self.width = specs[spec.io.features].shape[-1] if spec.io.features else 0
        self._features = np.zeros((cap * self.width,), dtype=np.float32) if spec.io.features else None  # [B * S * d]
        self.features: np.ndarray | None = None  # [B, S, d]: the last call's (a view), when the graph has them
        self.seqlens = np.zeros((self.rows,), dtype=np.int32)  # [B]: rows visible after the call - 1
        self.totals = np.ones((self.rows,), dtype=np.int32)  # [B]: rows visible after the call (graphs with io.totals)
        if not spec.io.totals and cache.views[0].device != "cpu":
            raise EngineError(f"graph {name} computes its attention's total length in the graph, which CUDA's GroupQueryAttention "
                              "reads wrong (docs/gpu.md); re-export the bundle with this specdec for a batched engine on a GPU, "
                              "or use max_batch=1")  # fmt: skip
        self._arange = np.arange(max(max_tokens, self.single), dtype=np.int64)  # [S_max] position offsets
        self.vocab, self.layers = vocab, layers
        # one binding per body: a call binds only the outputs of the body it runs (a rows graph's
        # other bodies return empty tensors, unfetched), and each binding keeps its rows' slots
        stale = stale_memories(cache.views[0].device, cache.views[0].dtype)
        self.bindings = {b: Binding(session, stale) for b in self.sizes}
        self.bound_slots = {b: [-1] * self.rows for b in self.sizes}  # body -> the slot each row is bound to
        self.bound_sources = {b: [(-1, -1)] * self.rows for b in self.sizes}  # body -> per row (slot, source length) of its cross K/V
        self.bound_tokens = {b: 0 for b in self.sizes}  # body -> the S its token-sized buffers are bound at
        for b in self.sizes:
            for r in range(self.rows):
                self._bind_row(b, r, cache.scratch)
                self._bind_source(b, r, cache.scratch)

    def _bind_row(self, body: int, r: int, slot: int) -> None:
        """Row r of ``body``'s calls reads (and, if the body runs it, writes) ``slot``'s KV."""
        view, binding = self.cache.slot(slot), self.bindings[body]
        for i, ptrs in enumerate(view.pointers()):
            (k_in, v_in), (k_out, v_out) = self.io.past[r * self.layers + i], self.io.present[r * self.layers + i]
            for tin, tout, ptr in ((k_in, k_out, ptrs[0]), (v_in, v_out, ptrs[1])):
                binding.bind_input(tin, view.memory, 0, view.dtype, list(view.shape), ptr)
                if r < body:
                    binding.bind_output(self.out(tout, body), view.memory, 0, view.dtype, list(view.shape), ptr)
        self.bound_slots[body][r] = slot

    def _bind_source(self, body: int, r: int, slot: int) -> None:
        """Row r of ``body``'s calls reads ``slot``'s cross K/V (an encoder-decoder graph)."""
        if self.cross is None:
            return
        cross, binding = self.cross[slot], self.bindings[body]
        for i, ptrs in enumerate(cross.pointers()):
            for tensor, ptr in zip(self.io.cross[r * self.layers + i], ptrs):
                binding.bind_input(tensor, "cpu", 0, cross.dtype, list(cross.shape), ptr)
        self.bound_sources[body][r] = (slot, cross.length)

    def _bind_tokens(self, body: int, s: int) -> None:
        b = self.bindings[body]
        b.bind_input(self.io.ids, "cpu", 0, np.int64, [body, s], self._ids.ctypes.data)
        b.bind_input(self.io.positions, "cpu", 0, np.int64, [body, s], self._pos.ctypes.data)
        b.bind_input(self.io.seqlens, "cpu", 0, np.int32, [body], self.seqlens.ctypes.data)
        for r, total in enumerate(self.io.totals):  # every row the graph takes, a scratch row's too
            b.bind_input(total, "cpu", 0, np.int32, [], self.totals.ctypes.data + r * self.totals.itemsize)
        b.bind_output(self.out(self.io.logits, body), "cpu", 0, np.float32, [body, s, self.vocab], self._logits.ctypes.data)
        if self._features is not None:
            b.bind_output(self.out(self.io.features, body), "cpu", 0, np.float32, [body, s, self.width], self._features.ctypes.data)
        self.bound_tokens[body] = s

    def size_for(self, n: int) -> int:
        """The B a call of ``n`` rows runs: the smallest body that holds them."""
        return next(b for b in self.sizes if b >= n)

    def run(self, slots: Sequence[int], feeds: Sequence[np.ndarray]) -> np.ndarray:
        rows, s = self._fill(slots, feeds)
        self._execute(rows, s, [slots[r] if r < len(slots) else self.cache.scratch for r in range(self.rows)])
        if self._features is not None:
            self.features = self._features[: rows * s * self.width].reshape(rows, s, self.width)  # [B, S, d] view
        return self._logits[: rows * s * self.vocab].reshape(rows, s, self.vocab)[: len(slots)]

    def _fill(self, slots: Sequence[int], feeds: Sequence[np.ndarray]) -> tuple[int, int]:
        """Check a call and write its host inputs (ids, positions, lengths); returns (B, S)."""
        n, s = len(slots), max(len(f) for f in feeds)
        limit = self.single if n == 1 and self.single else self.max_tokens
        if not 0 < n <= self.rows or not 0 < s <= limit:
            raise InputError(f"{self.name}: {n} rows of up to {s} tokens; this runner takes 1..{self.rows} rows of 1..{limit}")
        rows = self.size_for(n)
        ids, pos = self._ids[: rows * s].reshape(rows, s), self._pos[: rows * s].reshape(rows, s)
        for r in range(rows):
            slot = slots[r] if r < n else self.cache.scratch
            start = self.cache.slot(slot).length
            if start + s > self.cache.max_seq:
                raise InputError(f"{self.name}: slot {slot} rows {start}..{start + s} exceed max-seq-len {self.cache.max_seq}")
            if r < n:
                k = len(feeds[r])
                ids[r, :k] = feeds[r]
                ids[r, k:] = ids[r, k - 1]  # padding: later rows, never kept
            else:
                ids[r] = 0
            np.add(self._arange[:s], start, out=pos[r])
            self.seqlens[r] = start + s - 1
            self.totals[r] = start + s
        return rows, s

    def _execute(self, rows: int, s: int, slots: list[int]) -> None:
        """Run body ``rows`` at S = ``s``, row r over ``slots[r]`` (the scratch slot past the call's rows)."""
        for r, slot in enumerate(slots):
            if self.bound_slots[rows][r] != slot:
                self._bind_row(rows, r, slot)
            if self.cross is not None and self.bound_sources[rows][r] != (slot, self.cross[slot].length):
                self._bind_source(rows, r, slot)
        if s != self.bound_tokens[rows]:
            self._bind_tokens(rows, s)
        self.bindings[rows].run()

"""A graph runner: one ONNX Runtime graph of a bundle over buffers allocated once and bound once.

The graph's names, dtypes and shapes come from the manifest and are checked against the
session at load; which tensor is the ids, the positions, the logits, a length scalar or a
layer's KV is read from the manifest's ``GraphIO``. The KV inputs and outputs are bound to
the same ``KVCache`` buffers (ORT writes new rows in place). For a static graph every buffer
is bound once in ``__init__``; a call only writes ids and positions into preallocated arrays
and runs. A dynamic-length graph rebinds its token-sized buffers only when a call's length
differs from the last one's, with the same memory. Sessions are opened in engines/sessions.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import onnxruntime as ort

from specdec.engines.binding import Binding, stale_memories
from specdec.engines.kv import NP_DTYPES, CrossKV, KVCache
from specdec.engines.sessions import FLAVOURS, open_session
from specdec.engines.threads import ThreadPolicy
from specdec.errors import InputError, SignatureError
from specdec.manifest import GraphSpec


class GraphRunner:
    """Run one graph of a bundle over a model's ``KVCache``.

    ``run(tokens)`` feeds the tokens at positions [cache.length, cache.length + S), writes
    their KV rows there, and returns the logits [n, V] of the n real tokens. The returned
    array is a view of a buffer the next call overwrites: copy it to keep it. The cache's
    committed length is left to the caller (``cache.append`` / ``cache.rewind_to``).
    """

    def __init__(self, session: ort.InferenceSession, name: str, spec: GraphSpec, cache: KVCache, tokens: int | None = None):
        """``tokens``: run a dynamic-length graph at this fixed S, bound once like a static graph
        (how one session per model serves both shapes: weights in memory once)."""
        self.name, self.spec, self.cache, self.session, self.io_names = name, spec, cache, session, spec.io
        specs = {t.name: t for t in (*spec.inputs, *spec.outputs)}
        if tokens is not None and spec.tokens not in (None, tokens):
            raise SignatureError(f"graph {name} takes {spec.tokens} tokens per call, not {tokens}")
        self.static = tokens is not None or spec.tokens is not None
        self.capacity = (tokens or spec.tokens) if self.static else cache.max_seq  # max tokens per call
        vocab = specs[spec.io.logits].shape[-1]
        # Host buffers, allocated once. ids/pos/logits hold `capacity` tokens; a call uses a
        # prefix. Logits stay on the host even on CUDA: they are what acceptance reads.
        self.ids = np.zeros((1, self.capacity), dtype=np.int64)  # [1, S]
        self.pos = np.zeros((1, self.capacity), dtype=np.int64)  # [1, S]
        self.logits = np.zeros((1, self.capacity, vocab), dtype=np.float32)  # [1, S, V]
        # A feature drafter's tensors (export/features.py, export/head.py): the features the LM
        # head read, and the head's context input; None in graphs without them.
        width = specs[spec.io.features].shape[-1] if spec.io.features else specs[spec.io.context].shape[-1] if spec.io.context else 0
        self.features = np.zeros((1, self.capacity, width), dtype=np.float32) if spec.io.features else None  # [1, S, d]
        self.context = np.zeros((1, self.capacity, width), dtype=np.float32) if spec.io.context else None  # [1, S, d]
        self._arange = np.arange(self.capacity, dtype=np.int64)
        kv_spec = specs[spec.io.past[0][0]]
        self.kv_dtype = NP_DTYPES[kv_spec.dtype]
        self.binding = Binding(session, stale_memories(cache.device, self.kv_dtype))
        if self.kv_dtype != cache.dtype or len(spec.io.past) != len(cache.keys) or tuple(kv_spec.shape) != cache.shape:
            raise SignatureError(
                f"graph {name} takes {len(spec.io.past)} layers of {kv_spec.dtype} KV {list(kv_spec.shape)}, the cache holds "
                f"{len(cache.keys)} of {np.dtype(cache.dtype).name} {list(cache.shape)}; rebuild the cache from the manifest"
            )
        self._bind_scalars()
        self.bind_cache(cache)
        self.bound_tokens = 0  # S the token-sized buffers are bound for
        self.rebinds = 0  # how often they were (re)bound: once for a static graph
        self._bind_tokens(self.capacity if self.static else 1)

    def bind_cross(self, cross: CrossKV) -> None:
        """Read an encoder-decoder's cross-attention K/V from ``cross`` (after each encoder run:
        its source length sets their shape)."""
        for (k_name, v_name), ptrs in zip(self.io_names.cross, cross.pointers()):
            for tensor, ptr in zip((k_name, v_name), ptrs):
                self.binding.bind_input(tensor, "cpu", 0, cross.dtype, list(cross.shape), ptr)

    def bind_cache(self, cache: KVCache) -> None:
        """Run over ``cache`` from now on (another slot of the same shape): rebinds its buffers."""
        if cache.shape != self.cache.shape or cache.dtype != self.cache.dtype:
            raise SignatureError(f"graph {self.name}: a cache of {list(cache.shape)} cannot replace {list(self.cache.shape)}")
        self.cache = cache
        for (k_name, v_name), ptrs in zip(self.io_names.past, cache.pointers()):
            for tensor, ptr in zip((k_name, v_name), ptrs):
                self.binding.bind_input(tensor, cache.memory, 0, self.kv_dtype, list(cache.shape), ptr)
        self._bind_kv_outputs()

    def _bind_kv_outputs(self) -> None:
        """Present rows go straight into the cache: past and present are the same buffer."""
        c = self.cache
        for (k_name, v_name), ptrs in zip(self.io_names.present, c.pointers()):
            for tensor, ptr in zip((k_name, v_name), ptrs):
                self.binding.bind_output(tensor, c.memory, 0, self.kv_dtype, list(c.shape), ptr)

    def _bind_scalars(self) -> None:
        self.seqlens = np.zeros((1,), dtype=np.int32)  # [1]: total - 1
        self.total = np.zeros((), dtype=np.int32)  # []: rows visible after this call
        self.binding.bind_input(self.io_names.seqlens, "cpu", 0, np.int32, [1], self.seqlens.ctypes.data)
        self.binding.bind_input(self.io_names.total, "cpu", 0, np.int32, [], self.total.ctypes.data)

    def _set_scalars(self, start: int, s: int) -> None:
        self.seqlens[0] = start + s - 1
        self.total[()] = start + s

    def _store_new_rows(self, start: int, s: int) -> None:
        """Nothing to do: ORT wrote the rows in place."""

    def _bind_tokens(self, s: int) -> None:
        """(Re)bind the token-sized buffers for S = s; a static graph does this once."""
        io, b = self.io_names, self.binding
        b.bind_input(io.ids, "cpu", 0, np.int64, [1, s], self.ids.ctypes.data)
        b.bind_input(io.positions, "cpu", 0, np.int64, [1, s], self.pos.ctypes.data)
        b.bind_output(io.logits, "cpu", 0, np.float32, [1, s, self.logits.shape[-1]], self.logits.ctypes.data)
        for name, buf, bind in ((io.features, self.features, b.bind_output), (io.context, self.context, b.bind_input)):
            if buf is not None:
                bind(name, "cpu", 0, np.float32, [1, s, buf.shape[-1]], buf.ctypes.data)
        self.bound_tokens = s
        self.rebinds += 1

    def run(self, tokens: Sequence[int] | np.ndarray, context: np.ndarray | None = None) -> np.ndarray:
        """Logits [n, V] for ``tokens`` (n <= capacity), their KV written at [cache.length, ...);
        a graph with features also fills ``self.features[0, :n]``. ``context`` [n, d]: a feature
        head's input rows.

        Pass an int64 array (a view of a token buffer) to keep the call allocation-free.
        """
        n = len(tokens)
        s = self.capacity if self.static else n
        start = self.cache.length
        if not 0 < n <= self.capacity:
            raise InputError(f"{self.name}: {n} tokens per call; this graph takes 1..{self.capacity}")
        if start + s > self.cache.max_seq:
            raise InputError(f"{self.name}: rows {start}..{start + s} exceed max-seq-len {self.cache.max_seq}")
        self.ids[0, :n] = tokens
        if n < s:
            self.ids[0, n:s] = self.ids[0, n - 1]  # padding: later rows, never read, never kept
        if self.context is not None:
            self.context[0, :n] = context
        np.add(self._arange[:s], start, out=self.pos[0, :s])
        self._set_scalars(start, s)
        self._execute(start, s)
        return self.logits[0, :n]

    def _execute(self, start: int, s: int) -> None:
        """Run the graph on the filled host buffers (ids, positions, lengths) for S = s."""
        if s != self.bound_tokens:
            self._bind_tokens(s)
        self.binding.run()
        self._store_new_rows(start, s)


HIDDEN = -1e30  # tree_bias of a node that is not an ancestor


def fill_tree(parents: Sequence[int], bias: np.ndarray, depth: np.ndarray) -> None:
    """A tree's attention bias and depths, in place: ``bias`` [N, N] gets 0 where node j is node
    i or one of its ancestors, else HIDDEN; ``depth`` [N] each node's depth (0: under the root).
    ``parents`` [N]: -1 or an earlier node (topological order), else an InputError."""
    bias.fill(HIDDEN)
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise InputError(f"parents[{i}] = {parent}: expected -1 or an earlier node (topological order)")
        depth[i] = 0 if parent < 0 else depth[parent] + 1
        if parent >= 0:
            bias[i, :i] = bias[parent, :i]  # the parent's ancestors, and the parent itself
        bias[i, i] = 0.0


def tree_bias(parents: Sequence[int]) -> np.ndarray:
    """The tree_bias input [1, 1, N, N] float32 of a tree given by its parents (-1: under the root)."""
    n = len(parents)
    bias = np.empty((1, 1, n, n), dtype=np.float32)
    fill_tree(parents, bias[0, 0], np.zeros(n, dtype=np.int64))
    return bias


class TreeRunner(GraphRunner):
    """A tree verify graph (export/tree.py): N nodes, each at its depth's position, attending to
    the committed rows and its own ancestors. ``run_tree(tokens, parents)`` writes node i's KV
    at row cache.length + i and returns the logits [n, V] of the n real nodes; the caller keeps
    the accepted path with ``cache.keep``."""

    def __init__(self, session: ort.InferenceSession, name: str, spec: GraphSpec, cache: KVCache, tokens: int | None = None):
        super().__init__(session, name, spec, cache, tokens)
        n = self.capacity
        self.bias = np.full((1, 1, n, n), HIDDEN, dtype=np.float32)  # [1, 1, N, N]
        self.depth = np.zeros(n, dtype=np.int64)  # [N]
        self.binding.bind_input(spec.io.tree_bias, "cpu", 0, np.float32, [1, 1, n, n], self.bias.ctypes.data)

    def run_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        n, cap, start = len(tokens), self.capacity, self.cache.length
        if not 0 < n <= cap or len(parents) != n:
            raise InputError(f"{self.name}: a tree of {n} nodes ({len(parents)} parents); this graph takes 1..{cap} nodes")
        if start + cap > self.cache.max_seq:
            raise InputError(f"{self.name}: rows {start}..{start + cap} exceed max-seq-len {self.cache.max_seq}")
        try:  # padding nodes (past n): children of the root, never kept
            fill_tree([*parents, *[-1] * (cap - n)], self.bias[0, 0], self.depth)
        except InputError as e:
            raise InputError(f"{self.name}: {e}") from None
        self.ids[0, :n] = tokens
        self.ids[0, n:cap] = self.ids[0, 0]
        np.add(self.depth, start, out=self.pos[0, :cap])
        self._set_scalars(start, cap)
        self.binding.run()
        return self.logits[0, :n]


class PortableRunner(GraphRunner):
    """A portable-flavour graph (standard ops, static shapes): it reads the whole buffer, masked
    beyond ``past_length``, and returns only the new rows, which are copied into the cache."""

    def _bind_kv_outputs(self) -> None:
        c = self.cache
        heads, dim = c.shape[1], c.shape[3]
        # [1, kvH, S, D] per layer and tag, allocated once
        self.new_rows = [np.zeros((1, heads, self.capacity, dim), dtype=self.kv_dtype) for _ in range(2 * len(c.keys))]
        for i, (k_name, v_name) in enumerate(self.io_names.present):
            for j, tensor in enumerate((k_name, v_name)):
                buf = self.new_rows[2 * i + j]
                self.binding.bind_output(tensor, "cpu", 0, self.kv_dtype, list(buf.shape), buf.ctypes.data)

    def _bind_scalars(self) -> None:
        self.past_length = np.zeros((), dtype=np.int64)  # []
        self.binding.bind_input(self.io_names.past_length, "cpu", 0, np.int64, [], self.past_length.ctypes.data)

    def _set_scalars(self, start: int, s: int) -> None:
        self.past_length[()] = start

    def _store_new_rows(self, start: int, s: int) -> None:
        for i, (k, v) in enumerate(zip(self.cache.keys, self.cache.values)):
            k[:, :, start : start + s] = self.new_rows[2 * i]
            v[:, :, start : start + s] = self.new_rows[2 * i + 1]


RUNNERS = {"ort": GraphRunner, "portable": PortableRunner}
assert tuple(RUNNERS) == FLAVOURS  # what open_session accepts


class EncoderRunner:
    """An encoder-decoder's encoder graph: ``run(source)`` writes each decoder layer's
    cross-attention K/V for the source into a ``CrossKV``, once per request."""

    def __init__(self, session: ort.InferenceSession, name: str, spec: GraphSpec, cross: CrossKV):
        if len(spec.io.cross) != len(cross.buffers) // 2:
            raise SignatureError(f"graph {name} writes {len(spec.io.cross)} layers of cross K/V, the buffers hold {len(cross.buffers) // 2}")
        self.name, self.spec, self.session, self.cross = name, spec, session, cross
        self.ids = np.zeros((1, cross.max_source), dtype=np.int64)  # [1, N_max]
        self.binding = session.io_binding()
        self.binding.bind_input(spec.io.ids, "cpu", 0, np.int64, [1, 1], self.ids.ctypes.data)

    def run(self, source: Sequence[int] | np.ndarray) -> None:
        n = len(source)
        if not 0 < n <= self.cross.max_source:
            raise InputError(f"{self.name}: a source of {n} tokens; this bundle's encoder takes 1..{self.cross.max_source}")
        self.ids[0, :n] = source
        self.cross.length = n
        self.binding.bind_input(self.spec.io.ids, "cpu", 0, np.int64, [1, n], self.ids.ctypes.data)
        for (k_name, v_name), ptrs in zip(self.spec.io.cross, self.cross.pointers()):
            for tensor, ptr in zip((k_name, v_name), ptrs):
                self.binding.bind_output(tensor, "cpu", 0, self.cross.dtype, list(self.cross.shape), ptr)
        self.session.run_with_iobinding(self.binding)


class BatchEncoder:
    """An encoder-decoder's batched encoder graph (export/seq2seq.py ``export_encoder_batched``):
    ``run(sources, crosses)`` encodes 1..``rows`` sources in one call, right-padded to the longest
    and masked, and copies each one's K/V into its ``CrossKV`` (once per request, at admission).
    An engine with rows graphs runs every source through it, so the encoder's weights are packed
    once (traced at B >= 2, it runs B = 1 with the batch-1 encoder's outputs: checked in tests)."""

    def __init__(self, session: ort.InferenceSession, name: str, spec: GraphSpec, rows: int, max_source: int):
        if not spec.io.mask:
            raise SignatureError(f"graph {name} is not a batched encoder (no attention mask input)")
        self.name, self.spec, self.session, self.rows, self.max_source = name, spec, session, rows, max_source
        self.ids = np.zeros((rows * max_source,), dtype=np.int64)  # [B * N] viewed as [B, N] per call
        self.mask = np.zeros((rows * max_source,), dtype=np.int64)
        self.outputs = [n for pair in spec.io.cross for n in pair]

    def run(self, sources: Sequence[np.ndarray], crosses: Sequence[CrossKV]) -> None:
        b, n = len(sources), max(len(s) for s in sources)
        if not 1 <= b <= self.rows or not 0 < n <= self.max_source:
            raise InputError(f"{self.name}: {b} sources of up to {n} tokens; this encoder takes 1..{self.rows} of 1..{self.max_source}")
        ids, mask = self.ids[: b * n].reshape(b, n), self.mask[: b * n].reshape(b, n)
        ids[:], mask[:] = 0, 0  # padding: masked out, its outputs never kept
        for r, src in enumerate(sources):
            ids[r, : len(src)], mask[r, : len(src)] = src, 1
        kv = self.session.run(self.outputs, {self.spec.io.ids: ids, self.spec.io.mask: mask})  # per layer key, value [B, H, N, D]
        for r, (src, cross) in enumerate(zip(sources, crosses)):
            cross.write(kv, r, len(src))


def runner_for(
    bundle: Path,
    name: str,
    spec: GraphSpec,
    cache: KVCache,
    provider: str = "cpu",
    threads: ThreadPolicy | int | None = None,
    session: ort.InferenceSession | None = None,
    tokens: int | None = None,
) -> GraphRunner:
    """The runner for a graph's flavour over ``cache``; opens a session unless one is given.
    ``tokens``: a fixed S for a dynamic-length graph (see ``GraphRunner``)."""
    if session is None:
        session = open_session(bundle, name, spec, provider, threads)
    return RUNNERS[spec.flavour](session, name, spec, cache, tokens)


def fixed_tokens(manifest, model: str) -> int:
    """S of a model's fixed-length calls: K = γ + 1 for the target's verify, 1 for a draft step."""
    return manifest.k if model == "target" else 1


def fused_graph(manifest, role: str, batch: int = 1) -> tuple[str, GraphSpec] | None:
    """The (name, spec) of the draft's fused graph for ``role`` and ``batch`` rows, or None
    (bundles exported without --fused-draft, or before it existed)."""
    return next(((n, g) for n, g in manifest.graphs.items() if g.role == role and g.batch == batch), None)

"""KV rows moved where the cache lives: a tree's accepted path on a device cache.

``KVCache.keep`` moves rows of host buffers with NumPy. A device cache (CUDA; "ortvalue" on
the CPU runs the same path) is moved by the bundle's move graph (export/kv_move.py) on the
cache's own provider: one call per kept path that is not a prefix, every layer's key and
value in it, past and present bound to the same buffer, so no KV row crosses to the host.
What crosses per call: the two index vectors, 16 bytes a moved row.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnxruntime as ort

from specdec.engines.binding import Binding, stale_memories
from specdec.engines.kv import KVCache
from specdec.errors import SignatureError
from specdec.manifest import GraphSpec


class RowMover:
    """``keep(cache, rows)``: ``KVCache.keep`` on any cache of the graph's shape, by the move graph."""

    def __init__(self, session: ort.InferenceSession, name: str, spec: GraphSpec):
        self.name, self.spec, self.session = name, spec, session
        kv = next(t for t in spec.inputs if t.name == spec.io.past[0][0])
        self.shape, self.dtype = tuple(kv.shape), np.dtype(kv.dtype)
        rows = self.shape[2]
        self.src = np.zeros((rows,), dtype=np.int64)  # [MAX]: a call reads a prefix [m]
        self.dst = np.zeros((rows,), dtype=np.int64)
        self.bindings: dict[int, tuple[KVCache, Binding]] = {}  # id(cache) -> its binding, made at its first move
        self.calls = 0

    def keep(self, cache: KVCache, rows: Sequence[int]) -> None:
        """Commit rows ``cache.length + rows[k]`` at ``cache.length + k`` (ascending offsets)."""
        if cache.shape != self.shape or np.dtype(cache.dtype) != self.dtype or len(cache.keys) != len(self.spec.io.past):
            raise SignatureError(f"graph {self.name} moves {len(self.spec.io.past)} layers of {self.dtype.name} KV {list(self.shape)}, "
                                 f"the cache holds {len(cache.keys)} of {np.dtype(cache.dtype).name} {list(cache.shape)}")  # fmt: skip
        src, dst = cache.moves(list(rows))
        if src:
            m = len(src)
            self.src[:m], self.dst[:m] = src, dst
            binding = self._binding(cache)
            binding.bind_input(self.spec.io.ids, "cpu", 0, np.int64, [m], self.src.ctypes.data)
            binding.bind_input(self.spec.io.positions, "cpu", 0, np.int64, [m], self.dst.ctypes.data)
            binding.run()
            self.calls += 1
        cache.append(len(rows))

    def _binding(self, cache: KVCache) -> Binding:
        """The binding over ``cache``'s buffers: past and present the same memory, bound once."""
        if id(cache) not in self.bindings:
            b = Binding(self.session, stale_memories(cache.device, cache.dtype))
            for names, bind in ((self.spec.io.past, b.bind_input), (self.spec.io.present, b.bind_output)):
                for (k_name, v_name), ptrs in zip(names, cache.pointers()):
                    for tensor, ptr in zip((k_name, v_name), ptrs):
                        bind(tensor, cache.memory, 0, cache.dtype, list(cache.shape), ptr)
            self.bindings[id(cache)] = (cache, b)  # the cache kept: its id stays its own
        return self.bindings[id(cache)][1]

"""Fused draft calls: γ draft tokens for B rows in one ONNX Runtime call (export/fused.py).

Row r of a call feeds the last token of its sequence at its cache's committed length and
drafts γ tokens; the graph writes the KV rows of the fed token and of the first γ - 1 drafted
ones at [length, length + γ) of the row's cache, in place (every step's present output is bound
to the row's past buffer). Committing them is the caller's (``cache.append``).

The sampling variant takes per row a temperature (0: argmax), top-k (0: off), top-p (1: off)
and γ uniforms, drawn here from the row's own generator, and returns the q row each token was
drawn from; the greedy variant takes none of these and returns tokens only. Buffers are
allocated and bound once; a row's KV buffers are rebound only when the cache it serves changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import onnxruntime as ort

from specdec.engines.binding import Binding, stale_memories
from specdec.engines.kv import KVCache
from specdec.errors import InputError, SignatureError
from specdec.manifest import GraphSpec

if TYPE_CHECKING:
    from specdec.runtime.sampling import SamplingConfig


class FusedRunner:
    """Run one fused draft graph over the caches ``view(slot)`` (``scratch``: the slot unused
    rows write into, needed when the graph has more rows than a call uses)."""

    def __init__(self, session: ort.InferenceSession, name: str, spec: GraphSpec, view: Callable[[int], KVCache], scratch: int | None = None):
        self.name, self.spec, self.session, self.io, self.view, self.scratch = name, spec, session, spec.io, view, scratch
        self.rows, self.gamma = spec.batch, spec.tokens  # B, γ
        self.sampling = spec.io.uniforms is not None
        specs = {t.name: t for t in (*spec.inputs, *spec.outputs)}
        first = view(scratch if scratch is not None else 0)
        self.layers = len(first.keys)
        if len(spec.io.past) != self.rows * self.layers or tuple(specs[spec.io.past[0][0]].shape) != first.shape:
            raise SignatureError(f"graph {name} takes {len(spec.io.past)} KV pairs of {list(specs[spec.io.past[0][0]].shape)}, "
                                 f"the cache holds {self.layers} layers of {list(first.shape)}; rebuild it from the manifest")  # fmt: skip
        b, g = self.rows, self.gamma
        self.ids = np.zeros((b, 1), dtype=np.int64)  # [B, 1]
        self.pos = np.zeros((b, 1), dtype=np.int64)  # [B, 1]
        self.seqlens = np.zeros((b,), dtype=np.int32)  # [B]: the fed token's row
        self.tokens = np.zeros((b, g), dtype=np.int64)  # [B, γ]
        self.binding = Binding(session, stale_memories(first.device, first.dtype))
        feeds = [(self.io.ids, self.ids), (self.io.positions, self.pos), (self.io.seqlens, self.seqlens)]
        if self.sampling:
            vocab = specs[spec.io.logits].shape[-1]
            self.uniforms = np.zeros((b, g), dtype=np.float32)  # [B, γ]
            self.temperature = np.zeros((b,), dtype=np.float32)  # [B]
            self.top_k = np.zeros((b,), dtype=np.int64)  # [B]
            self.top_p = np.ones((b,), dtype=np.float32)  # [B]
            self.probs = np.zeros((b, g, vocab), dtype=np.float32)  # [B, γ, V]
            feeds += [(self.io.uniforms, self.uniforms), (self.io.temperature, self.temperature), (self.io.top_k, self.top_k), (self.io.top_p, self.top_p)]
            self.binding.bind_output(self.io.logits, "cpu", 0, np.float32, list(self.probs.shape), self.probs.ctypes.data)
        for tensor, arr in feeds:
            self.binding.bind_input(tensor, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
        self.binding.bind_output(self.io.tokens, "cpu", 0, np.int64, list(self.tokens.shape), self.tokens.ctypes.data)
        self.bound: list[KVCache | None] = [None] * b
        for r in range(b):
            self._bind_row(r, first)

    def _bind_row(self, r: int, cache: KVCache) -> None:
        pairs, b = self.rows * self.layers, self.binding
        for i, (k_ptr, v_ptr) in enumerate(cache.pointers()):
            k_in, v_in = self.io.past[r * self.layers + i]
            b.bind_input(k_in, cache.memory, 0, cache.dtype, list(cache.shape), k_ptr)
            b.bind_input(v_in, cache.memory, 0, cache.dtype, list(cache.shape), v_ptr)
            for j in range(self.gamma):  # step j's write goes into the same buffers
                k_out, v_out = self.io.present[j * pairs + r * self.layers + i]
                b.bind_output(k_out, cache.memory, 0, cache.dtype, list(cache.shape), k_ptr)
                b.bind_output(v_out, cache.memory, 0, cache.dtype, list(cache.shape), v_ptr)
        self.bound[r] = cache

    def run(self, slots: Sequence[int], last: Sequence[int], cfgs: Sequence[SamplingConfig] = (), rngs: Sequence[np.random.Generator] = ()) -> np.ndarray:
        """Draft γ tokens for each of ``slots`` after its ``last`` token; returns tokens [n, γ]
        (a view the next call overwrites; the sampling variant's q rows are ``probs[:n]``).
        ``cfgs``/``rngs``: each row's sampling settings and generator (sampling variant)."""
        n = len(slots)
        if not 0 < n <= self.rows:
            raise InputError(f"{self.name}: {n} rows; this graph drafts for 1..{self.rows}")
        for r in range(self.rows):
            used = r < n
            cache = self.view(slots[r] if used else self.scratch)
            start = cache.length
            if start + self.gamma > cache.max_seq:
                raise InputError(f"{self.name}: rows {start}..{start + self.gamma} exceed max-seq-len {cache.max_seq}")
            self.ids[r, 0] = last[r] if used else 0
            self.pos[r, 0] = self.seqlens[r] = start
            if self.bound[r] is not cache:
                self._bind_row(r, cache)
            if self.sampling:
                cfg = cfgs[r] if used else None
                self.temperature[r] = cfg.temperature if cfg else 0.0
                self.top_k[r] = (cfg.top_k or 0) if cfg else 0
                self.top_p[r] = cfg.top_p if cfg and cfg.top_p is not None else 1.0
                if cfg and not cfg.greedy:
                    rngs[r].random(dtype=np.float32, out=self.uniforms[r])
        self.binding.run()
        return self.tokens[:n]

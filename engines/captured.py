"""Fixed-length calls replayed as CUDA graphs (provider "cuda-graph").

At 135M on an H100 or H200 a decoding call is bound by launching its hundreds of kernels from the
host, not by the GPU: the target's one-token call took 2.97 ms run node by node and 1.58 ms
replayed as one captured CUDA graph, with the same tokens (docs/gpu.md, the fourth run). ONNX
Runtime's CUDA provider captures a run when the session has ``enable_cuda_graph`` and replays
it on every later run with the same graph id (the run option ``gpu_graph_id``), reading and
writing the very buffers it was captured with. So a ``CapturedRunner``:

- holds every input in device memory at a fixed address (ids, positions and ``seqlens_k``,
  written by a host-to-device copy before each run) and the logits in a device buffer, read
  back after it;
- binds ``total_sequence_length``, which GroupQueryAttention reads on the host when the graph
  is captured and never again, once, at the cache's length: each call's own length reaches
  attention through ``seqlens_k`` (the fourth run: rewritten before each replay, the total
  gave wrong tokens; fixed at the cache length, the runtime's);
- keeps one captured graph per KV cache it runs over (a cache slot, a fork's cache): a graph
  id and a binding of its own each, since a replay reads the KV addresses it was captured with.

The executor keeps one such runner per call length up to the verify's γ + 1 (a smaller γ, an
adaptive one, a draft catching up), made at the first call of that length; longer calls (prompt
chunks) run on the same session uncaptured (graph id -1, ``engines/binding.py``). The runner works on the CPU provider too, where nothing is captured,
so the CPU tests run its buffers and lengths (tests/runtime/test_device_path.py).
"""

from __future__ import annotations

import itertools

import numpy as np
import onnxruntime as ort

from specdec.engines.batch import BatchRunner, SlotCache
from specdec.engines.kv import MEMORY, KVCache
from specdec.engines.ort import GraphRunner
from specdec.errors import SignatureError

_GRAPH_IDS = itertools.count(1)  # ORT reserves 0 for its own single graph and -1 for "not captured"


class CapturedRunner(GraphRunner):
    """A batch-1 graph at a fixed S (a verify, a one-token call, a draft step), replayed as a
    CUDA graph per KV cache; ``run`` is ``GraphRunner.run``'s."""

    def __init__(self, session: ort.InferenceSession, name: str, spec, cache: KVCache, tokens: int):
        self.graphs: dict[int, tuple] = {}  # id(cache) -> (cache, binding, run options): one captured graph each
        super().__init__(session, name, spec, cache, tokens)

    def _bind_scalars(self) -> None:
        """Device buffers for every input and the logits, made once (a replay reads these
        addresses); called by ``GraphRunner.__init__`` before the cache is bound."""
        memory, s, vocab = MEMORY[self.cache.device], self.capacity, self.logits.shape[-1]
        device = lambda a: ort.OrtValue.ortvalue_from_numpy(a, memory, 0)  # noqa: E731
        self.seqlens = np.zeros((1,), dtype=np.int32)  # [1]: rows visible after the call - 1
        self.total = np.array(self.cache.max_seq, dtype=np.int32)  # []: fixed (see the module docstring)
        self.d_ids, self.d_pos = device(self.ids[:, :s]), device(self.pos[:, :s])  # [1, S] each
        self.d_seqlens = device(self.seqlens)  # [1]
        self.h_total = ort.OrtValue.ortvalue_from_numpy(self.total)  # [] on the host: attention reads it there
        self.d_logits = device(np.zeros((1, s, vocab), dtype=np.float32))  # [1, S, V]
        # a feature graph's (the target's features out, the head's context in): float32 [1, S, d] each
        self.d_features = device(self.features[:, :s]) if self.features is not None else None
        self.d_context = device(self.context[:, :s]) if self.context is not None else None

    def _set_scalars(self, start: int, s: int) -> None:
        self.seqlens[0] = start + s - 1

    def _bind_tokens(self, s: int) -> None:
        """Nothing to rebind: S is fixed and the buffers are bound per cache (``bind_cache``)."""
        self.bound_tokens = s
        self.rebinds += 1

    def bind_cache(self, cache: KVCache) -> None:
        """Run over ``cache`` from now on: its own binding and graph id, made at its first use."""
        if cache.shape != self.cache.shape or cache.dtype != self.cache.dtype:
            raise SignatureError(f"graph {self.name}: a cache of {list(cache.shape)} cannot replace {list(self.cache.shape)}")
        self.cache = cache
        if id(cache) not in self.graphs:
            self.graphs[id(cache)] = (cache, *self._binding_for(cache))  # the cache kept: its id stays its own

    def _binding_for(self, cache: KVCache) -> tuple[ort.IOBinding, ort.RunOptions]:
        io, b = self.io_names, self.session.io_binding()
        for name, value in ((io.ids, self.d_ids), (io.positions, self.d_pos), (io.seqlens, self.d_seqlens), (io.total, self.h_total)):
            b.bind_ortvalue_input(name, value)
        b.bind_ortvalue_output(io.logits, self.d_logits)
        if self.d_features is not None:
            b.bind_ortvalue_output(io.features, self.d_features)
        if self.d_context is not None:
            b.bind_ortvalue_input(io.context, self.d_context)
        for names, bind in ((io.past, b.bind_input), (io.present, b.bind_output)):  # present written in place over past
            for (k_name, v_name), ptrs in zip(names, cache.pointers()):
                for tensor, ptr in zip((k_name, v_name), ptrs):
                    bind(tensor, cache.memory, 0, self.kv_dtype, list(cache.shape), ptr)
        options = ort.RunOptions()
        options.add_run_config_entry("gpu_graph_id", str(next(_GRAPH_IDS)))
        return b, options

    def _execute(self, start: int, s: int) -> None:
        _, binding, options = self.graphs[id(self.cache)]
        self.d_ids.update_inplace(self.ids[:, :s])  # host -> device: 8 bytes a token, each
        self.d_pos.update_inplace(self.pos[:, :s])
        self.d_seqlens.update_inplace(self.seqlens)
        if self.d_context is not None:
            self.d_context.update_inplace(self.context[:, :s])  # host -> device: 4 bytes a feature, S x d
        self.session.run_with_iobinding(binding, options)
        # device -> host: ORT's Python API reads a device tensor into a new array (S x V floats)
        np.copyto(self.logits[:, :s], self.d_logits.numpy())
        if self.d_features is not None:
            np.copyto(self.features[:, :s], self.d_features.numpy())  # S x d floats


MAX_ARRANGEMENTS = 32  # captured graphs per batched runner and call length; calls past them run uncaptured


class CapturedBatchRunner(BatchRunner):
    """A fixed-B batched graph (``--batch-graphs per-size``: no If nodes, which ONNX Runtime does not
    capture) replayed as a CUDA graph per call length S (1..γ + 1) and *arrangement*: the slot
    each of its B rows runs over (the scratch slot for rows a call leaves empty). A replay reads
    the KV addresses it was captured with, so an arrangement is captured once, at its first call,
    and replayed whenever the same slots decode together again (a batch's rows keep their
    slots for a request's life); past ``MAX_ARRANGEMENTS`` per S a call runs uncaptured. Inputs
    live in device buffers per S (ids, positions, ``seqlens_k``), each row's attention total is
    bound once at the cache length (as ``CapturedRunner``'s), and the logits (and features) are
    read back after each replay: S x V floats a row."""

    def __init__(self, session: ort.InferenceSession, name: str, spec, cache: SlotCache, max_tokens: int):
        if spec.rows:
            raise SignatureError(f"graph {name} is a rows graph (If nodes, not captured); a captured batch needs --batch-graphs per-size")
        super().__init__(session, name, spec, cache, max_tokens)
        self.memory = MEMORY[cache.views[0].device]
        self.h_total = ort.OrtValue.ortvalue_from_numpy(np.array(cache.max_seq, dtype=np.int32))  # []: read on the host at capture
        self.device: dict[int, dict[str, ort.OrtValue]] = {}  # S -> its device buffers
        self.graphs: dict[tuple, tuple] = {}  # (S, slots per row) -> (binding, run options)
        self.uncaptured = 0  # calls past MAX_ARRANGEMENTS

    def _buffers(self, s: int) -> dict[str, ort.OrtValue]:
        if s not in self.device:
            b, device = self.rows, lambda shape, dtype: ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype=dtype), self.memory, 0)  # noqa: E731
            self.device[s] = {"ids": device((b, s), np.int64), "pos": device((b, s), np.int64), "seqlens": device((b,), np.int32),
                              "logits": device((b, s, self.vocab), np.float32)}  # fmt: skip
            if self._features is not None:
                self.device[s]["features"] = device((b, s, self.width), np.float32)
        return self.device[s]

    def _captured(self, s: int, slots: tuple) -> tuple | None:
        key = (s, slots)
        if key not in self.graphs:
            if sum(k[0] == s for k in self.graphs) >= MAX_ARRANGEMENTS:
                return None
            io, d, b = self.io, self._buffers(s), self.session.io_binding()
            for name, value in ((io.ids, d["ids"]), (io.positions, d["pos"]), (io.seqlens, d["seqlens"])):
                b.bind_ortvalue_input(name, value)
            for total in io.totals:
                b.bind_ortvalue_input(total, self.h_total)
            b.bind_ortvalue_output(io.logits, d["logits"])
            if "features" in d:
                b.bind_ortvalue_output(io.features, d["features"])
            for r, slot in enumerate(slots):
                view = self.cache.slot(slot)
                for i, ptrs in enumerate(view.pointers()):
                    (k_in, v_in), (k_out, v_out) = io.past[r * self.layers + i], io.present[r * self.layers + i]
                    for tin, tout, ptr in ((k_in, k_out, ptrs[0]), (v_in, v_out, ptrs[1])):
                        b.bind_input(tin, view.memory, 0, view.dtype, list(view.shape), ptr)
                        b.bind_output(tout, view.memory, 0, view.dtype, list(view.shape), ptr)
            options = ort.RunOptions()
            options.add_run_config_entry("gpu_graph_id", str(next(_GRAPH_IDS)))
            self.graphs[key] = (b, options)
        return self.graphs[key]

    def _execute(self, rows: int, s: int, slots: list[int]) -> None:
        found = self._captured(s, tuple(slots))
        if found is None:
            self.uncaptured += 1
            return super()._execute(rows, s, slots)
        binding, options = found
        d, n = self.device[s], rows * s
        d["ids"].update_inplace(self._ids[:n].reshape(rows, s))  # host -> device: 8 bytes a token, each
        d["pos"].update_inplace(self._pos[:n].reshape(rows, s))
        d["seqlens"].update_inplace(self.seqlens)
        self.session.run_with_iobinding(binding, options)
        self._logits[: n * self.vocab] = d["logits"].numpy().reshape(-1)  # device -> host: S x V floats a row
        if "features" in d:
            self._features[: n * self.width] = d["features"].numpy().reshape(-1)

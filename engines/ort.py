"""An ONNX Runtime decoder graph run over buffers allocated once and bound once.

The graph's names, dtypes and shapes come from the manifest and are checked against the
session at load. Its KV inputs and outputs are bound to the same ``KVCache`` buffers (ORT
writes new rows in place). For a static graph every buffer is bound once in ``__init__``; a
call only writes ids and positions into preallocated arrays and runs. A dynamic-length
(prefill) graph rebinds its token-sized buffers per call, with the same memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import onnxruntime as ort

from specdec.engines.kv import NP_DTYPES, KVCache
from specdec.errors import EngineError, InputError, SignatureError
from specdec.manifest import GraphSpec

ORT_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)", "int64": "tensor(int64)", "int32": "tensor(int32)", "bool": "tensor(bool)"}
PROVIDERS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
}
DEVICE = {"cpu": "cpu", "cuda": "cuda", "tensorrt": "cuda"}  # where a provider's KV buffers live


_shared_pool: int | None = None  # intra-op threads of the process-wide pool, once share_threads ran


def share_threads(threads: int | None = None) -> None:
    """Run every specdec session created from now on over ONE process-wide ORT thread pool.

    A decode alternates between the draft's and the target's sessions. With a pool per session
    their workers must sleep between calls (see ``session_options``) and pay a wake-up on every
    op; one shared pool may spin, because only one session runs at a time. Measured on this
    2-core CPU (demo pair, 4 prompts x 2 rounds): autoregressive 338-463 vs 272-295 tok/s,
    γ = 5 607-947 vs 564-644 tok/s. Sessions created before the call keep their own pools
    (checked: the process gains one pool worker, not one per session), but afterwards ONNX
    Runtime refuses to create any session with a pool of its own (``use_per_session_threads
    must be false``), also other libraries' (optimum's, for one). That is why a library user
    opts in; the CLI does, for its own process. ``threads``:
    pool size (None: ORT's default, one per core); the first call fixes it, and the ``threads``
    argument of later sessions is then ignored.
    """
    global _shared_pool
    import onnxruntime.capi._pybind_state as C

    if threads is not None and threads < 1:
        raise InputError(f"threads={threads}: expected an integer >= 1 or None")
    if _shared_pool is None:
        C.set_global_thread_pool_sizes(threads or 0, 1)
        _shared_pool = threads or 0


def session_options(threads: int | None = None) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    if _shared_pool is not None:
        so.use_per_session_threads = False  # the process-wide pool; it may spin (one session runs at a time)
        return so
    if threads:
        so.intra_op_num_threads = threads
    # A decode alternates between the draft's and the target's sessions. Spinning worker
    # threads of the idle session would compete with the busy one for the same cores (measured
    # on 2 cores: a verify call ran 2.5x slower inside the loop than alone), so threads sleep.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return so


def _shape_matches(want: tuple, got: list) -> bool:
    if len(want) != len(got):
        return False
    return all(isinstance(w, str) and not isinstance(g, int) or w == g for w, g in zip(want, got))


def check_signature(name: str, session: ort.InferenceSession, spec: GraphSpec) -> None:
    """Refuse a graph whose inputs/outputs differ from the manifest; say what differs."""
    problems = []
    for kind, want, have in (("input", spec.inputs, session.get_inputs()), ("output", spec.outputs, session.get_outputs())):
        got = {t.name: t for t in have}
        missing = sorted({t.name for t in want} - set(got))
        extra = sorted(set(got) - {t.name for t in want})
        if missing:
            problems.append(f"lacks {kind}s {missing}")
        if extra:
            problems.append(f"has unexpected {kind}s {extra}")
        for t in want:
            g = got.get(t.name)
            if g is None:
                continue
            if g.type != ORT_TYPES[t.dtype]:
                problems.append(f"{kind} {t.name} is {g.type}, manifest says {t.dtype}")
            if not _shape_matches(t.shape, g.shape):
                problems.append(f"{kind} {t.name} has shape {g.shape}, manifest says {list(t.shape)}")
    if problems:
        raise SignatureError(f"graph {name} ({spec.file}) differs from the manifest: {'; '.join(problems)}; re-export with specdec-export")


class OrtDecoder:
    """Run one decoder graph of a bundle over a model's ``KVCache``.

    ``run(tokens)`` feeds the tokens at positions [cache.length, cache.length + S), writes
    their KV rows there, and returns the logits [n, V] of the n real tokens. The returned
    array is a view of a buffer the next call overwrites: copy it to keep it. The cache's
    committed length is left to the caller (``cache.append`` / ``cache.rewind_to``).
    """

    def __init__(self, session: ort.InferenceSession, name: str, spec: GraphSpec, cache: KVCache):
        self.name, self.spec, self.cache, self.session = name, spec, cache, session
        specs = {t.name: t for t in (*spec.inputs, *spec.outputs)}
        self.static = spec.tokens is not None
        self.capacity = spec.tokens if self.static else cache.max_seq  # max tokens per call
        vocab = specs["logits"].shape[-1]
        # Host buffers, allocated once. ids/pos/logits hold `capacity` tokens; a call uses a
        # prefix. Logits stay on the host even on CUDA: they are what acceptance reads.
        self.ids = np.zeros((1, self.capacity), dtype=np.int64)  # [1, S]
        self.pos = np.zeros((1, self.capacity), dtype=np.int64)  # [1, S]
        self.seqlens = np.zeros((1,), dtype=np.int32)  # [1]: total - 1
        self.total = np.zeros((), dtype=np.int32)  # []: rows visible after this call
        self.logits = np.zeros((1, self.capacity, vocab), dtype=np.float32)  # [1, S, V]
        self._arange = np.arange(self.capacity, dtype=np.int64)
        self.io = self.session.io_binding()
        self.kv_dtype = NP_DTYPES[specs["past_key_0"].dtype]
        if self.kv_dtype != cache.dtype:
            raise SignatureError(f"graph {name} takes {specs['past_key_0'].dtype} KV, the cache holds {np.dtype(cache.dtype).name}; rebuild the decoder from the manifest")
        for i, ptrs in enumerate(cache.pointers()):
            for tag, ptr in zip(("key", "value"), ptrs):
                self.io.bind_input(f"past_{tag}_{i}", cache.device, 0, self.kv_dtype, list(cache.shape), ptr)
        self._bind_kv_outputs()
        self._bind_scalars()
        self._bound = 0
        self._bind_tokens(self.capacity if self.static else 1)

    def _bind_kv_outputs(self) -> None:
        """Present rows go straight into the cache: past and present are the same buffer."""
        c = self.cache
        for i, ptrs in enumerate(c.pointers()):
            for tag, ptr in zip(("key", "value"), ptrs):
                self.io.bind_output(f"present_{tag}_{i}", c.device, 0, self.kv_dtype, list(c.shape), ptr)

    def _bind_scalars(self) -> None:
        self.io.bind_input("seqlens_k", "cpu", 0, np.int32, [1], self.seqlens.ctypes.data)
        self.io.bind_input("total_sequence_length", "cpu", 0, np.int32, [], self.total.ctypes.data)

    def _set_scalars(self, start: int, s: int) -> None:
        self.seqlens[0] = start + s - 1
        self.total[()] = start + s

    def _store_new_rows(self, start: int, s: int) -> None:
        """Nothing to do: ORT wrote the rows in place."""

    def _bind_tokens(self, s: int) -> None:
        """(Re)bind the token-sized buffers for S = s; a static graph does this once."""
        self.io.bind_input("input_ids", "cpu", 0, np.int64, [1, s], self.ids.ctypes.data)
        self.io.bind_input("position_ids", "cpu", 0, np.int64, [1, s], self.pos.ctypes.data)
        self.io.bind_output("logits", "cpu", 0, np.float32, [1, s, self.logits.shape[-1]], self.logits.ctypes.data)
        self._bound = s

    def run(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """Logits [n, V] for ``tokens`` (n <= capacity), their KV written at [cache.length, ...).

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
        np.add(self._arange[:s], start, out=self.pos[0, :s])
        self._set_scalars(start, s)
        if s != self._bound:
            self._bind_tokens(s)
        self.session.run_with_iobinding(self.io)
        self._store_new_rows(start, s)
        return self.logits[0, :n]


class PortableDecoder(OrtDecoder):
    """A portable-flavour graph (standard ops, static shapes): it reads the whole buffer, masked
    beyond ``past_length``, and returns only the new rows, which are copied into the cache."""

    def _bind_kv_outputs(self) -> None:
        c = self.cache
        heads, dim = c.keys[0].shape[1], c.keys[0].shape[3]
        # [1, kvH, S, D] per layer and tag, allocated once
        self.new_rows = [np.zeros((1, heads, self.capacity, dim), dtype=self.kv_dtype) for _ in range(2 * len(c.keys))]
        for i in range(len(c.keys)):
            for j, tag in enumerate(("key", "value")):
                buf = self.new_rows[2 * i + j]
                self.io.bind_output(f"new_{tag}_{i}", "cpu", 0, self.kv_dtype, list(buf.shape), buf.ctypes.data)

    def _bind_scalars(self) -> None:
        self.past_length = np.zeros((), dtype=np.int64)  # []
        self.io.bind_input("past_length", "cpu", 0, np.int64, [], self.past_length.ctypes.data)

    def _set_scalars(self, start: int, s: int) -> None:
        self.past_length[()] = start

    def _store_new_rows(self, start: int, s: int) -> None:
        for i, (k, v) in enumerate(zip(self.cache.keys, self.cache.values)):
            k[:, :, start : start + s] = self.new_rows[2 * i]
            v[:, :, start : start + s] = self.new_rows[2 * i + 1]


DECODERS = {"ort": OrtDecoder, "portable": PortableDecoder}


def open_session(bundle: Path, name: str, spec: GraphSpec, provider: str = "cpu", threads: int | None = None) -> ort.InferenceSession:
    """An ONNX Runtime session for one bundle graph, its signature checked against the manifest.

    Sessions are thread-safe and hold the weights; decoders (buffers and bindings) are not,
    so several decoders may share one session.
    """
    if provider not in PROVIDERS:
        raise EngineError(f"provider {provider!r} is not supported; use one of {sorted(PROVIDERS)}")
    if PROVIDERS[provider][0] not in ort.get_available_providers():
        raise EngineError(
            f"provider {provider!r} needs {PROVIDERS[provider][0]}, which this onnxruntime lacks; "
            "install onnxruntime-gpu (pip install 'specdec[gpu]') or use provider='cpu'"
        )
    if spec.flavour not in DECODERS:
        raise EngineError(f"graph {name} has flavour {spec.flavour!r}; ONNX Runtime runs {sorted(DECODERS)}")
    if spec.flavour == "portable" and DEVICE[provider] != "cpu":
        raise EngineError(f"graph {name} is a portable graph, which this engine runs on the CPU only; use provider='cpu' or the ort graphs")
    session = ort.InferenceSession(str(bundle / spec.file), session_options(threads), providers=PROVIDERS[provider])
    check_signature(name, session, spec)
    return session


def decoder_for(
    bundle: Path,
    name: str,
    spec: GraphSpec,
    cache: KVCache,
    provider: str = "cpu",
    threads: int | None = None,
    session: ort.InferenceSession | None = None,
) -> OrtDecoder:
    """The engine for a graph's flavour over ``cache``; opens a session unless one is given."""
    if session is None:
        session = open_session(bundle, name, spec, provider, threads)
    return DECODERS[spec.flavour](session, name, spec, cache)

"""One model's KV cache: buffers allocated once at load, appended in place, rolled back in O(1)."""

from __future__ import annotations

import numpy as np

from specdec.errors import EngineError, InputError

NP_DTYPES = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32, "bool": np.bool_}
# Where a cache's buffers live -> the memory ORT binds them as. "ortvalue" keeps host memory in
# OrtValues, the way a device cache is kept: the device code path, run where there is no GPU.
MEMORY = {"cpu": "cpu", "cuda": "cuda", "ortvalue": "cpu"}
DEVICES = tuple(MEMORY)


class KVCache:
    """Per layer a key and a value buffer [1, kvH, MAX, D]; rows [0, length) are committed.

    Graphs write the rows of a call at [length, length + S) in place; the caller then keeps
    some of them with ``append`` and forgets the rest. Rows past ``length`` are never read
    (attention reads [0, total) of the call that wrote them), so a rollback is a length change.

    On ``device="cuda"`` the buffers are device OrtValues (``keys``/``values`` are then
    OrtValues, not arrays; "ortvalue" does the same in host memory); engines bind them by
    pointer either way (``pointers``), as ``memory``.
    """

    def __init__(self, layers: int, kv_heads: int, max_seq: int, head_dim: int, dtype: str, device: str = "cpu"):
        if device not in DEVICES:
            raise EngineError(f"KV cache device {device!r}: expected one of {DEVICES}")
        self.shape = (1, kv_heads, max_seq, head_dim)
        self.dtype = NP_DTYPES[dtype]
        self.device, self.memory = device, MEMORY[device]
        self.keys = [self._buffer() for _ in range(layers)]
        self.values = [self._buffer() for _ in range(layers)]
        self.max_seq = max_seq
        self.length = 0

    @classmethod
    def over(cls, keys: list[np.ndarray], values: list[np.ndarray]) -> KVCache:
        """A cache over existing host buffers [1, kvH, MAX, D] per layer (e.g. one slot of a
        ``SlotCache``), with its own committed length."""
        cache = cls.__new__(cls)
        cache.shape, cache.dtype, cache.device, cache.memory = tuple(keys[0].shape), keys[0].dtype.type, "cpu", "cpu"
        cache.keys, cache.values, cache.max_seq, cache.length = keys, values, keys[0].shape[2], 0
        return cache

    def _buffer(self):
        if self.device == "cpu":
            return np.zeros(self.shape, dtype=self.dtype)  # [1, kvH, MAX, D]
        import onnxruntime as ort

        buf = ort.OrtValue.ortvalue_from_shape_and_type(list(self.shape), self.dtype, self.memory, 0)
        # Zeroed once: fresh device memory holds old bytes, and CUDA's float16 GroupQueryAttention
        # reads rows past the valid ones, where a NaN poisons the output (measured on an H100).
        buf.update_inplace(np.zeros(self.shape, dtype=self.dtype))  # [1, kvH, MAX, D]
        return buf

    def pointers(self) -> list[tuple[int, int]]:
        """(key, value) data pointers per layer, for I/O binding."""
        ptr = (lambda b: b.ctypes.data) if self.device == "cpu" else (lambda b: b.data_ptr())
        return [(ptr(k), ptr(v)) for k, v in zip(self.keys, self.values)]

    def append(self, n: int) -> None:
        """Commit the next ``n`` rows that the last call wrote."""
        if n < 0:
            raise InputError(f"KV cache append of {n} rows: expected a count >= 0 (use rewind_to to forget rows)")
        if self.length + n > self.max_seq:
            raise InputError(f"KV cache append of {n} rows at length {self.length} exceeds max-seq-len {self.max_seq}")
        self.length += n

    def keep(self, rows: list[int]) -> None:
        """Commit some rows of the last call, in order: row ``length + rows[k]`` moves to
        ``length + k`` (a tree's accepted path: its nodes' rows, ascending, since a node comes
        after its parent). Copies len(rows) rows per layer at most; a prefix (0, 1, ..) copies none.
        Host buffers; a device cache moves them with the bundle's move graph (engines/move.py)."""
        src, dst = self.moves(rows)
        if src and self.device != "cpu":
            raise EngineError(f"KV cache keep({list(rows)}): moving rows of a device cache takes the bundle's move graph (engines/move.py)")
        for buf in (*self.keys, *self.values) if src else ():
            buf[:, :, dst] = buf[:, :, src]  # [1, kvH, m, D]: fancy indexing reads a copy first
        self.append(len(rows))

    def moves(self, rows: list[int]) -> tuple[list[int], list[int]]:
        """The absolute positions ``keep(rows)`` reads and writes: only the rows that move."""
        if any(not 0 <= r < self.max_seq - self.length for r in rows) or any(a >= b for a, b in zip(rows, rows[1:])):
            raise InputError(f"KV cache keep({list(rows)}) at length {self.length}: expected ascending positions of the last call's rows, "
                             f"as offsets in [0, {self.max_seq - self.length})")
        moved = [k for k, r in enumerate(rows) if r != k]
        return [self.length + rows[k] for k in moved], [self.length + k for k in moved]

    def rewind_to(self, n: int) -> None:
        """Forget every row from ``n`` on; O(1)."""
        if not 0 <= n <= self.length:
            raise InputError(f"rewind_to({n}) outside the committed rows [0, {self.length}]")
        self.length = n

    def reset(self) -> None:
        self.length = 0


class CrossKV:
    """An encoder-decoder's cross-attention K/V: per decoder layer a key and a value [1, H, N, D]
    for a source of N <= ``max_source`` tokens. Each is the prefix of a flat buffer allocated
    once, so the encoder writes it and every decoder call reads it by pointer, never copied."""

    def __init__(self, layers: int, heads: int, max_source: int, head_dim: int, dtype: str):
        self.heads, self.head_dim, self.max_source = heads, head_dim, max_source
        self.dtype = NP_DTYPES[dtype]
        self.buffers = [np.zeros((heads * max_source * head_dim,), dtype=self.dtype) for _ in range(2 * layers)]  # [H*N_max*D] each
        self.length = 0  # N of the source encoded last

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (1, self.heads, self.length, self.head_dim)

    def pointers(self) -> list[tuple[int, int]]:
        """(key, value) data pointers per layer, for I/O binding."""
        b = self.buffers
        return [(b[i].ctypes.data, b[i + 1].ctypes.data) for i in range(0, len(b), 2)]

    def copy_from(self, other: CrossKV) -> None:
        """Take ``other``'s encoded source (what its encoder wrote), instead of encoding it again."""
        n = other.heads * other.length * other.head_dim
        for mine, theirs in zip(self.buffers, other.buffers):
            mine[:n] = theirs[:n]
        self.length = other.length

    def write(self, kv: list[np.ndarray], row: int, n: int) -> None:
        """Take row ``row``'s first ``n`` source positions of a batched encoder's outputs ``kv``
        (key_0, value_0, key_1, ... [B, H, N, D]) as this source's K/V: one copy, at admission."""
        for mine, theirs in zip(self.buffers, kv):
            mine[: self.heads * n * self.head_dim].reshape(self.heads, n, self.head_dim)[:] = theirs[row, :, :n]
        self.length = n

    def views(self) -> list[np.ndarray]:
        """key_0, value_0, key_1, ... as [1, H, N, D] arrays over the buffers."""
        n = self.heads * self.length * self.head_dim
        return [b[:n].reshape(self.shape) for b in self.buffers]

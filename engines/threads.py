"""How ONNX Runtime's intra-op threads are pooled: chosen explicitly at load, never a hidden switch.

A decode alternates between the draft's and the target's sessions on the same cores, so how
their worker threads wait between calls matters (measurements: docs/performance.md "ONNX Runtime threads",
``docs/bench/threads.md``):

- ``ThreadPolicy.per_session(n)`` (the default): each session has its own pool of n threads
  that spin while a call runs and stop spinning when it returns, so the idle model's workers
  never compete with the busy one's. Touches no process-wide state. ``spin=False`` makes the
  workers sleep between ops too (no busy-waiting at all: for machines shared with other work).
- ``ThreadPolicy.shared(n)``: every specdec session runs on ONE process-wide pool that may
  spin, since only one session runs at a time. Faster on a small CPU, but process-wide: ONNX
  Runtime creates that pool once per process and from then on refuses any session with a
  pool of its own, specdec's or another library's (optimum's, for one). For processes that
  own ONNX Runtime, such as the CLI's.

Per-session pools spin within a call unless ``$SPECDEC_SPIN=0`` (measured: spinning is 14-24%
faster for SmolLM2 on an idle 2-core box and 27-30% slower beside one busy process; docs/performance.md).
Threads default to one per core, or to ``$SPECDEC_THREADS`` where it is set: the way to size
every session of a process and of its children (the server's, the CLI's) at once, e.g. in a
container whose CPU quota is below the machine's core count, or for processes that share cores
(the test suite's workers).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import onnxruntime as ort

from specdec.engines import blocks_op
from specdec.errors import EngineError, InputError

_global_pool: int | None = None  # the process-wide pool's size (0: one thread per core), once made
ENV = "SPECDEC_THREADS"
SPIN_ENV = "SPECDEC_SPIN"


def default_threads() -> int | None:
    """``$SPECDEC_THREADS`` (an integer >= 1), else None: ONNX Runtime's one thread per core."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise InputError(f"{ENV}={text!r}: expected an integer >= 1 (intra-op threads per session), or unset for one per core")
    return int(text)


def default_spin() -> bool:
    """``$SPECDEC_SPIN`` (1 or 0), else 1: whether per-session pools spin within a call. On a box
    shared with other busy work, spinning workers take turns with it and lose; there 0 was
    1.4x faster for SmolLM2 (docs/performance.md "ONNX Runtime threads"), on an idle box 1 is."""
    text = os.environ.get(SPIN_ENV, "").strip()
    if text not in ("", "0", "1"):
        raise InputError(f"{SPIN_ENV}={text!r}: expected 1 (workers spin within a call: an idle machine) or 0 (they sleep: a machine shared with busy work)")
    return text != "0"


@dataclass(frozen=True)
class ThreadPolicy:
    """Intra-op threads per pool (None: ONNX Runtime's default, one per core) and whether the
    pool is the process-wide shared one."""

    threads: int | None = None  # None: $SPECDEC_THREADS, else one per core
    shared_pool: bool = False
    spin: bool | None = None  # per-session pools: spin while a call runs (never between calls); None: $SPECDEC_SPIN, else True

    def __post_init__(self) -> None:
        if self.threads is None:
            object.__setattr__(self, "threads", default_threads())
        if self.spin is None:
            object.__setattr__(self, "spin", default_spin())
        t = self.threads
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise InputError(f"threads={t!r}: expected an integer >= 1, or None for one per core")

    @classmethod
    def per_session(cls, threads: int | None = None, spin: bool | None = None) -> ThreadPolicy:
        return cls(threads, False, spin)

    @classmethod
    def shared(cls, threads: int | None = None) -> ThreadPolicy:
        return cls(threads, True, True)

    @classmethod
    def of(cls, threads: ThreadPolicy | int | None) -> ThreadPolicy:
        """A policy as given, or the default policy with ``threads`` threads."""
        return threads if isinstance(threads, ThreadPolicy) else cls.per_session(threads)

    @property
    def label(self) -> str:
        """What the stats record, e.g. "per-session x2" or "shared x(cores)"."""
        kind = "shared" if self.shared_pool else "per-session" if self.spin else "per-session, no spin"
        return f"{kind} x{self.threads or '(cores)'}"

    def session_options(self) -> ort.SessionOptions:
        """Options for one session under this policy (creates the shared pool on first use)."""
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        blocks_op.register(so)  # quantized graphs' MatMulBlocks (engines/blocks_op.py)
        if self.shared_pool:
            _ensure_global_pool(self.threads or 0)
            so.use_per_session_threads = False
            return so
        if _global_pool is not None:
            raise EngineError(
                "this process already runs ONNX Runtime's shared thread pool, after which ORT refuses sessions with pools of "
                "their own; load with threads=ThreadPolicy.shared(...)"
            )
        if self.threads:
            so.intra_op_num_threads = self.threads
        if self.spin:
            so.add_session_config_entry("session.force_spinning_stop", "1")  # spin within a call, sleep after it
        else:
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return so


def _ensure_global_pool(threads: int) -> None:
    """ONNX Runtime's process-wide pool, made once; the one private-API call in specdec."""
    global _global_pool
    if _global_pool is None:
        import onnxruntime.capi._pybind_state as C

        C.set_global_thread_pool_sizes(threads, 1)
        _global_pool = threads
    elif _global_pool != threads:
        raise EngineError(
            f"this process's shared ONNX Runtime pool has {_global_pool or 'one per core'} threads, not {threads or 'one per core'}: "
            "ONNX Runtime makes it once per process; ask for the same size, or use ThreadPolicy.per_session"
        )

"""BatchEngine: continuous batching; many requests share each graph call, each keeps its own exact output.

    submit(prompt, params) ──► bounded queue ──► engine thread, each iteration:
        admit:  waiting requests take free slots (``Engine.start``)
        step:   the engine core (runtime/engine.py): a joining row feeds its prompt in chunks of
                PREFILL_CHUNK tokens, one chunk per iteration, and decodes once it is fed, so a
                long prompt never stalls the rows in flight for long; then one
                ``speculative_step`` over every decoding row: batched propose, ONE target call
                (row r feeds [last_r, x_1..x_k_r], padded to the widest row), Algorithm 1 per
                row with its own settings and generator, commit, emit to each row's Handle

A row alone runs the batch-1 graphs, exactly as ``SpeculativeDecoder`` (the same engine with
one slot); padding rows and padded tokens write only past a slot's committed length or into
a scratch slot, so they are never read. A failed graph call fails the rows in it, never the
engine.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Sequence

from specdec.engines.threads import ThreadPolicy
from specdec.errors import ConfigError, InputError, QueueFullError, SpecDecError
from specdec.manifest import Manifest, load_manifest
from specdec.store import local
from specdec.runtime.drafters import bundle_default, check_drafter
from specdec.runtime.engine import Engine
from specdec.runtime.handles import Handle
from specdec.runtime.beam_search import BeamResult, BeamRunner
from specdec.runtime.params import BeamParams, SamplingParams
from specdec.runtime.loader import Loaded

MAX_CACHE_SLOTS = 64  # KV slots a BatchEngine may allocate (each a full max-seq-len cache per model)
PREFILL_CHUNK = 32  # prompt tokens a joining row feeds per iteration (a 32-token call: a few ms on the demo target)


class BatchEngine:
    """Decode up to ``max_batch`` requests together on one bundle exported with ``--max-batch``.

    ``submit`` is thread-safe and returns a ``Handle`` at once (bad requests raise their typed
    error there, and a full queue raises ``QueueFullError``); one engine thread runs every
    graph call. ``generate_many`` is the blocking convenience. ``close()`` stops the thread.
    Every drafter runs here, a user's own ``Drafter`` object included, and encoder-decoder
    bundles too (``submit(source)``: each row over its own source's cross K/V, encoded once per
    slot; several rows a call when the bundle was exported with ``--max-batch``).

    ``observer``, when set, is called by the engine thread after each iteration with one
    ``Iteration`` per row decoded in it (what a metrics exporter counts); keep it quick.
    """

    def __init__(self, bundle: str | Path, max_batch: int | None = None, drafter=None, threads: ThreadPolicy | int | None = None,
                 max_queue: int = 64, provider: str = "cpu", manifest: Manifest | None = None, verify: str = "full",
                 prefix_reuse: bool = True, cache_slots: int | None = None, draft_provider: str | None = None):  # fmt: skip
        """``manifest``: the bundle's, when the caller has loaded (and verified) it already;
        ``verify``: how ``load_manifest`` checks the bundle otherwise ("full" or "size").
        ``prefix_reuse``: a request takes the idle slot holding the longest prefix of its prompt
        and feeds only the rest (a finished request's KV stays in its slot until evicted, least
        recently used first). ``cache_slots``: KV slots allocated at load, >= ``max_batch`` (the
        rows decoded together); more slots keep more conversations' prefixes [default: max_batch].
        ``drafter``, ``draft_provider``: as ``SpeculativeDecoder.load``'s (None: the bundle's default; the target's provider)."""
        bundle = local(bundle)  # a stored bundle's URI: this machine's verified copy
        m = self.manifest = manifest or load_manifest(bundle, verify)
        drafter = bundle_default(m) if drafter is None else drafter
        self.max_batch = self.check_options(m, max_batch, drafter, max_queue, cache_slots)
        self.cache_slots = slots = self.max_batch if cache_slots is None else cache_slots
        self.loaded, drafter = Loaded.open(bundle, drafter, self.max_batch, provider, threads, manifest=m, draft_provider=draft_provider)
        self.limits, self.codec, self.threads = self.loaded.limits(drafter), self.loaded.codec, self.loaded.threads
        sessions = self.loaded.sessions
        self.beams = BeamRunner(bundle, m, sessions, provider, self.threads, self.codec, draft_provider)  # beam searches, beside the rows in flight
        self.engine = Engine(bundle, m, sessions, drafter, slots, provider, prefill_chunk=PREFILL_CHUNK, reuse=prefix_reuse, rows=self.max_batch,
                             draft_provider=draft_provider)  # fmt: skip
        self.drafter_name = self.engine.proposer.name
        self.waiting: queue.Queue = queue.Queue(maxsize=max_queue)
        self.max_queue = max_queue
        self._group = threading.Lock()  # held while a group is queued (submit_together): admission waits for all of it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="specdec-batch", daemon=True)
        self._thread.start()

    @staticmethod
    def check_options(m: Manifest, max_batch: int | None, drafter, max_queue: int, cache_slots: int | None = None) -> int:
        """Refuse options this bundle cannot run (a ``ConfigError``); returns the row count."""
        rows = m.max_batch if max_batch is None else max_batch
        ok_batch = isinstance(rows, int) and not isinstance(rows, bool) and 1 <= rows <= m.max_batch
        if not ok_batch or isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ConfigError(f"max_batch={max_batch!r}, max_queue={max_queue!r}: expected 1..{m.max_batch} rows (the bundle's --max-batch) and a queue >= 1")
        slots = rows if cache_slots is None else cache_slots
        if not isinstance(slots, int) or isinstance(slots, bool) or not rows <= slots <= MAX_CACHE_SLOTS:
            raise ConfigError(f"cache_slots={cache_slots!r}: expected {rows}..{MAX_CACHE_SLOTS} (at least max_batch, the rows decoded together)")
        check_drafter(drafter)
        return rows

    @property
    def occupancy(self):
        """Decoding rows per iteration -> iterations."""
        return self.engine.occupancy

    @property
    def observer(self):
        return self.engine.observer

    @observer.setter
    def observer(self, fn) -> None:
        self.engine.observer = fn

    # -- the public interface ---------------------------------------------------------------

    def submit(self, prompt: str | Sequence[int] | None = None, params: SamplingParams | None = None, *, source: str | Sequence[int] | None = None,
               block: bool = False, **fields) -> Handle:  # fmt: skip
        """Check a request and queue it; raises its typed error, or ``QueueFullError`` when
        ``max_queue`` requests already wait (``block=True`` waits for room instead).

        ``params``: a ``SamplingParams``, or its fields by keyword; ``prompt``/``source`` as
        ``SpeculativeDecoder.request`` (an encoder-decoder bundle's first argument is the source)."""
        handle = self._handle(prompt, params if params is not None else SamplingParams.of(**fields), source)
        try:
            self.waiting.put(handle, block=block)
        except queue.Full:
            raise self._full() from None
        return handle

    def submit_together(self, requests: Sequence[tuple[str | Sequence[int], SamplingParams]], *, source: str | Sequence[int] | None = None) -> list[Handle]:
        """Queue ``(prompt, params)`` pairs as one group (a request's choices): every one is checked
        first, so a typed error queues none, and none is admitted before all are queued, so the
        choices of one prompt start in the same step and feed it once (the others copy its rows).
        ``QueueFullError`` when the queue lacks room for all of them (none stays queued)."""
        if len(requests) > self.max_queue:  # could never be queued whole: the request's fault, not the load's
            raise InputError(f"{len(requests)} requests in one group exceed the queue's {self.max_queue}; ask for fewer choices, "
                             "or give the engine a larger max_queue (specdec serve --max-queue)")  # fmt: skip
        handles = [self._handle(prompt, params, source) for prompt, params in requests]
        with self._group:
            if self.max_queue - self.waiting.qsize() < len(handles):
                raise self._full()
            for i, handle in enumerate(handles):
                try:
                    self.waiting.put_nowait(handle)
                except queue.Full:
                    for queued in handles[:i]:
                        queued.cancel()  # dropped at admission
                    raise self._full() from None
        return handles

    def _handle(self, prompt, params: SamplingParams, source) -> Handle:
        """A checked request's handle (its typed error otherwise), not yet queued."""
        if self._stop.is_set():
            raise QueueFullError("the batch engine is closed; create a new one")
        req = self.loaded.request(prompt, params, self.limits, source)
        return Handle(req, self.codec, self.loaded.stats(req, self.drafter_name))

    def _full(self) -> QueueFullError:
        return QueueFullError(f"{self.max_queue} requests are already waiting for {self.max_batch} slots; retry later")

    def beam_search(self, prompt: str | Sequence[int] | None = None, params: BeamParams | None = None, *,
                    source: str | Sequence[int] | None = None, **fields) -> BeamResult:  # fmt: skip
        """``SpeculativeDecoder.beam_search`` on this engine's sessions, on the caller's thread: its
        own KV slots, beside the rows the engine thread decodes (one search at a time)."""
        params = params if params is not None else BeamParams.of(**fields)
        return self.beams.run(self.loaded.request(prompt, params.request_params, self.limits, source), params)

    def generate_many(self, prompts: Sequence[str | Sequence[int]], **kw) -> list:
        """Decode every prompt (all in flight together, up to max_batch at a time); waits for all."""
        handles = [self.submit(p, block=True, **kw) for p in prompts]
        return [h.result() for h in handles]

    def close(self) -> None:
        """Stop the engine thread; requests in flight or waiting end with finish_reason "cancelled"."""
        self._stop.set()
        self._thread.join()
        for row in list(self.engine.rows.values()):
            self.engine.free(row, "cancelled")
        while not self.waiting.empty():
            self.waiting.get_nowait().finish("cancelled")

    def __enter__(self) -> BatchEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        """Whether the engine thread is running (False after ``close`` or if it died)."""
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def active(self) -> int:
        return len(self.engine.rows)

    # -- the loop -------------------------------------------------------------------------------

    def _loop(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._admit()
            if not engine.rows:
                continue
            try:
                engine.step()
            except Exception as e:  # a failed graph call fails the rows in it, never the engine
                for row in list(engine.rows.values()):
                    engine.free(row, "error", e if isinstance(e, SpecDecError) else RuntimeError(f"decoding failed: {e}"))

    def _admit(self) -> None:
        """Fill free slots from the queue (waiting briefly when nothing runs)."""
        engine = self.engine
        while len(engine.rows) < self.max_batch and engine.free_slot() is not None:
            try:
                handle = self.waiting.get(timeout=0.05) if not engine.rows else self.waiting.get_nowait()
            except queue.Empty:
                return
            with self._group:  # a group being queued is queued whole before any of it starts
                pass
            if handle.cancelled.is_set():
                handle.finish("cancelled")
                continue
            slot = engine.slot_for(handle.request)
            try:
                engine.start(handle.request, handle, slot)
            except Exception as e:
                engine.leave(slot)
                handle.finish("error", RuntimeError(f"prefill failed: {e}"))

"""BatchEngine: continuous batching; many requests share each graph call, each keeps its own exact output.

    submit() ──► bounded queue ──► engine thread, each iteration:
        admit:  waiting requests take free slots; a joining row feeds its prompt in chunks of
                PREFILL_CHUNK tokens, one chunk per iteration (batch-1 dynamic graph), and decodes
                once it is fed, so a long prompt never stalls the rows in flight for long
        width:  each row's γ: its request's, or the adaptive policy's for this many rows
        draft:  draft model: one fused call drafting γ tokens for every row that drafts the
                bundle's γ (export/fused.py), else one batched call per draft step for all rows
                still drafting; prompt lookup / n-gram tables: per row
        verify: ONE target call: row r feeds [last_r, x_1..x_k_r], padded to the widest row
        accept: Algorithm 1 per row, with that row's sampling settings and RNG
        commit: each slot keeps n_r + 1 rows, the draft slot forgets the rejected ones;
                finished, failed and cancelled rows free their slot at once

A row is the same state ``SpeculativeDecoder`` keeps for one request (token buffer, q rows,
committed length), held per slot; padding rows and padded tokens write only past a slot's
committed length or into a scratch slot, so they are never read. One row alone runs the
batch-1 graphs, as fast as ``SpeculativeDecoder``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from specdec.engines.batch import BatchRunner, SlotCache
from specdec.engines.fused import FusedRunner
from specdec.engines.ort import GraphRunner, fixed_tokens, fused_graph, open_session, runner_for
from specdec.engines.threads import ThreadPolicy
from specdec.errors import ConfigError, InputError, QueueFullError, SpecDecError
from specdec.manifest import FUSED_ROLES, load_manifest
from specdec.runtime.adaptive import Acceptance, AdaptiveGamma
from specdec.runtime.decoder import clip
from specdec.runtime.drafters import DrafterContext, check_drafter, make_drafter, needs_draft_model
from specdec.runtime.handles import Handle
from specdec.runtime.request import Limits, Request
from specdec.runtime.sampling import draw
from specdec.runtime.speculative import accept
from specdec.runtime.stats import Iteration, Stats
from specdec.runtime.text import TextCodec

clock = time.perf_counter
PREFILL_CHUNK = 32  # prompt tokens a joining row feeds per iteration (a 32-token call: a few ms on the demo target)


class Forward:
    """One model's logits [n, S, V] for n slots' feeds: one row runs the batch-1 graphs (the
    static graph when the feed fills it), more rows the smallest batched graph that fits."""

    def __init__(self, cache: SlotCache, dynamic: GraphRunner, static: GraphRunner, batched: dict[int, BatchRunner]):
        self.cache, self.dynamic, self.static, self.batched = cache, dynamic, static, batched
        self.calls = 0

    def __call__(self, slots: Sequence[int], feeds: Sequence[np.ndarray]) -> np.ndarray:
        self.calls += 1
        if len(slots) == 1:
            return self.one(slots[0], feeds[0])[None]
        rows = min(b for b in self.batched if b >= len(slots))
        return self.batched[rows].run(slots, feeds)

    def one(self, slot: int, feed: np.ndarray) -> np.ndarray:
        """Logits [len(feed), V] of one slot through a batch-1 graph."""
        runner = self.static if len(feed) == self.static.capacity else self.dynamic
        view = self.cache.slot(slot)
        if runner.cache is not view:
            runner.bind_cache(view)
        return runner.run(feed)


@dataclass
class Row:
    """One request in flight, in slot ``slot``."""

    req: Request
    handle: Handle
    slot: int
    seq: np.ndarray  # [MAX] committed + proposed tokens (this slot's row of BatchEngine.seqs)
    q: np.ndarray  # [γ, V] the draft rows proposals were drawn from
    rng: np.random.Generator
    length: int  # L: committed tokens
    left: int  # tokens still to emit
    ready: bool = False  # prompt fed (see BatchEngine._prefill)


class BatchEngine:
    """Decode up to ``max_batch`` requests together on one bundle exported with ``--max-batch``.

    ``submit`` is thread-safe and returns a ``Handle`` at once (bad requests raise their typed
    error there, and a full queue raises ``QueueFullError``); one engine thread runs every
    graph call. ``generate_many`` is the blocking convenience. ``close()`` stops the thread.

    ``observer``, when set, is called by the engine thread after each iteration with one
    ``Iteration`` per row decoded in it (what a metrics exporter counts); keep it quick.
    """

    def __init__(self, bundle: str | Path, max_batch: int | None = None, drafter: str = "model",
                 threads: ThreadPolicy | int | None = None, max_queue: int = 64):  # fmt: skip
        bundle = Path(bundle)
        m = self.manifest = load_manifest(bundle)
        self.max_batch = self.check_options(m, max_batch, drafter, max_queue)
        self.limits, self.codec, self.threads = Limits.of(m), TextCodec.from_bundle(bundle, m), ThreadPolicy.of(threads)
        self.target = self._forward(bundle, "target")
        self.draft = self._forward(bundle, "draft") if needs_draft_model(drafter) else None
        self.fused = self._fused(bundle) if drafter == "model" else {}  # (rows, greedy) -> FusedRunner; "model-steps": none
        ctx = DrafterContext(bundle, m, None)
        self.drafters = None if self.draft else [make_drafter(drafter, ctx) for _ in range(self.max_batch)]  # per slot
        self.drafter_name = drafter
        self.seqs = np.zeros((self.max_batch, m.max_seq_len), dtype=np.int64)  # [slots, MAX]
        self.qs = np.zeros((self.max_batch, m.gamma, m.vocab_size), dtype=np.float64)  # [slots, γ, V]
        self.rows: dict[int, Row] = {}  # slot -> row in flight
        self.policies: dict[int, AdaptiveGamma] = {}  # adaptive γ per graph row count (see _policy)
        self.acceptance = Acceptance()  # shared by the policies: α does not depend on the batch
        self.waiting: queue.Queue = queue.Queue(maxsize=max_queue)
        self.max_queue = max_queue
        self.occupancy: Counter = Counter()  # rows per iteration -> iterations
        self.observer: Callable[[list[Iteration]], None] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="specdec-batch", daemon=True)
        self._thread.start()

    @staticmethod
    def check_options(m, max_batch: int | None, drafter: str, max_queue: int) -> int:
        """Refuse options this bundle cannot run (a ``ConfigError``); returns the row count."""
        if m.seq2seq:
            raise ConfigError("this is an encoder-decoder bundle; the batched engine and the server run decoder-only bundles so far: "
                              "use SpeculativeDecoder (specdec generate --source) for it")  # fmt: skip
        rows = m.max_batch if max_batch is None else max_batch
        ok_batch = isinstance(rows, int) and not isinstance(rows, bool) and 1 <= rows <= m.max_batch
        if not ok_batch or isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ConfigError(f"max_batch={max_batch!r}, max_queue={max_queue!r}: expected 1..{m.max_batch} rows (the bundle's --max-batch) and a queue >= 1")
        check_drafter(drafter)
        if drafter == "hierarchical" or not isinstance(drafter, str):
            raise ConfigError(f"drafter={drafter!r}: the batched engine runs model, ngram, unigram and lookup")
        return rows

    def _forward(self, bundle: Path, model: str) -> Forward:
        """One model's slot cache and runners: the batch-1 runners (both on the session of its
        dynamic-length graph, as in the decoder) and a runner per batched graph up to the
        smallest that holds ``max_batch`` rows (each batched graph is a session of its own)."""
        m, spec = self.manifest, getattr(self.manifest, model)
        cache = SlotCache(spec.num_layers, spec.num_kv_heads, m.max_seq_len, spec.head_dim, m.dtype, self.max_batch)
        name, g = m.graph(model, "dynamic")
        session = open_session(bundle, name, g, "cpu", self.threads)
        runners = [runner_for(bundle, name, g, cache.slot(0), session=session, tokens=t) for t in (None, fixed_tokens(m, model))]
        batched = {}
        for b in m.batch_sizes():
            if self.max_batch == 1 or max(batched, default=0) >= self.max_batch:
                break  # sizes ascend: every call of up to max_batch rows has a graph
            name, g = m.graph(model, "dynamic", batch=b)
            batched[b] = BatchRunner(open_session(bundle, name, g, "cpu", self.threads), name, g, cache, m.k)
        if self.max_batch > 1 and max(batched, default=0) < self.max_batch:
            raise ConfigError(f"bundle has no batched graph for {self.max_batch} rows; re-export with --max-batch {self.max_batch}")
        return Forward(cache, *runners, batched)

    def _fused(self, bundle: Path) -> dict[tuple[int, bool], FusedRunner]:
        """The draft's fused graphs over the draft slot cache, per (rows, greedy variant): batch 1
        and each batched size up to the one holding ``max_batch`` rows. Empty for a bundle
        without them (drafting then runs step by step)."""
        m, cache, out = self.manifest, self.draft.cache, {}
        for rows in (1, *self.target.batched):
            for role in FUSED_ROLES:
                found = fused_graph(m, role, rows)
                if found:
                    out[rows, role == "fused_greedy"] = FusedRunner(open_session(bundle, *found, "cpu", self.threads), *found, cache.slot, cache.scratch)
        return out

    # -- the public interface ---------------------------------------------------------------

    def submit(self, prompt: str | Sequence[int], max_new_tokens: int = 128, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, seed: int | None = None, gamma: int | str | None = None, ignore_eos: bool = False,
               lenience: float = 1.0, stop_token_ids: Sequence[int] = (), block: bool = False) -> Handle:  # fmt: skip
        """Check a request and queue it; raises its typed error, or ``QueueFullError`` when
        ``max_queue`` requests already wait (``block=True`` waits for room instead)."""
        if self._stop.is_set():
            raise QueueFullError("the batch engine is closed; create a new one")
        if isinstance(prompt, str):
            if self.codec is None:
                raise InputError("prompt is text but the bundle has no tokenizer; pass token ids instead")
            prompt = self.codec.encode(prompt)
        req = Request(prompt, self.limits, max_new_tokens, temperature, top_k, top_p, seed, gamma, ignore_eos, lenience, stop_token_ids)
        stats = Stats(gamma=req.gamma, prompt_tokens=len(req.prompt), drafter=self.drafter_name, adaptive=req.adaptive,
                      lenience=req.lenience, threads=self.threads.label)  # fmt: skip
        handle = Handle(req, self.codec, stats)
        try:
            self.waiting.put((req, handle), block=block)
        except queue.Full:
            raise QueueFullError(f"{self.max_queue} requests are already waiting for {self.max_batch} slots; retry later") from None
        return handle

    def generate_many(self, prompts: Sequence[str | Sequence[int]], **kw) -> list:
        """Decode every prompt (all in flight together, up to max_batch at a time); waits for all."""
        handles = [self.submit(p, block=True, **kw) for p in prompts]
        return [h.result() for h in handles]

    def close(self) -> None:
        """Stop the engine thread; requests in flight or waiting end with finish_reason "cancelled"."""
        self._stop.set()
        self._thread.join()
        for row in list(self.rows.values()):
            self._free(row, "cancelled")
        while not self.waiting.empty():
            self.waiting.get_nowait()[1]._finish("cancelled")

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
        return len(self.rows)

    # -- the loop -------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._admit()
            if not self.rows:
                continue
            try:
                self.step()
            except Exception as e:  # a failed graph call fails the rows in it, never the engine
                for row in list(self.rows.values()):
                    self._free(row, "error", e if isinstance(e, SpecDecError) else RuntimeError(f"decoding failed: {e}"))

    def _admit(self) -> None:
        """Fill free slots from the queue (waiting briefly when nothing runs)."""
        while len(self.rows) < self.max_batch:
            try:
                req, handle = self.waiting.get(timeout=0.05) if not self.rows else self.waiting.get_nowait()
            except queue.Empty:
                return
            if handle.cancelled.is_set():
                handle._finish("cancelled")
                continue
            slot = next(s for s in range(self.max_batch) if s not in self.rows)
            try:
                self._start(req, handle, slot)
            except Exception as e:
                handle._finish("error", RuntimeError(f"prefill failed: {e}"))

    def _start(self, req: Request, handle: Handle, slot: int) -> None:
        """Give ``req`` the slot; its prompt is fed in chunks by the next iterations (``_prefill``)."""
        L, seq = len(req.prompt), self.seqs[slot]
        seq[:L] = req.prompt
        for fwd in (self.target, self.draft) if self.draft else (self.target,):
            fwd.cache.slot(slot).reset()
        handle.start_time = clock()
        self.rows[slot] = Row(req, handle, slot, seq, self.qs[slot], np.random.default_rng(req.seed), L, req.max_new_tokens)

    def _prefill(self, r: Row) -> bool:
        """Feed the next ``PREFILL_CHUNK`` prompt tokens of a joining row (prompt[:-1], alone
        through the batch-1 dynamic graphs), so a long prompt stalls the rows in flight for one
        chunk per iteration, not for the whole prompt. Returns whether the row is ready."""
        t0, end = clock(), r.length - 1
        views = [fwd.cache.slot(r.slot) for fwd in ((self.target, self.draft) if self.draft else (self.target,))]
        done = views[0].length
        if done < end:
            stop = min(end, done + PREFILL_CHUNK)
            for fwd, view in zip((self.target, self.draft), views):
                fwd.one(r.slot, r.seq[done:stop])
                view.append(stop - done)
        ready = views[0].length == end
        if ready and self.drafters:
            self.drafters[r.slot].start(r.seq, r.length)
        r.ready = ready
        r.handle.stats.prefill_seconds += clock() - t0
        return ready

    def step(self) -> None:
        """One iteration for every row in flight: draft, one batched verify, accept, commit, emit."""
        for row in [r for r in self.rows.values() if r.handle.cancelled.is_set()]:
            self._free(row, "cancelled")
        rows = [r for r in self.rows.values() if r.ready or self._prefill(r)]
        if not rows:
            return
        policy = self._policy(len(rows)) if any(r.req.adaptive for r in rows) else None
        width = policy.next() if policy else 0
        gammas = [min(width if r.req.adaptive else r.req.gamma, r.left - 1) for r in rows]
        t0, calls = clock(), self.draft.calls if self.draft else 0
        ks = self._draft(rows, gammas)
        t1 = clock()
        logits = self.target([r.slot for r in rows], [r.seq[r.length - 1 : r.length + k] for r, k in zip(rows, ks)])  # [n, S, V]
        t2 = clock()
        verdicts = [accept(r.seq[r.length : r.length + k], r.q[:k], logits[i, : k + 1], r.req.sampling, r.rng, r.req.lenience)
                    for i, (r, k) in enumerate(zip(rows, ks))]  # fmt: skip
        for r, k, (n, token) in zip(rows, ks, verdicts):
            self._commit(r, k, n, token)
        t3 = clock()
        draft_calls = (self.draft.calls - calls) if self.draft else sum(1 for k in ks if k)
        if policy:  # a batch's acceptance step (per-row standardizing) is part of what verifying k costs
            policy.observe(ks, [v[0] for v in verdicts], draft_calls, t1 - t0, t3 - t1)
        self.occupancy[len(rows)] += 1
        its = [Iteration(k, n, draft_calls, t1 - t0, t2 - t1, t3 - t2) for k, (n, _) in zip(ks, verdicts)]
        for r, it in zip(rows, its):
            r.handle.stats.record(it)
            self._emit(r, it.accepted)
        if self.observer:
            self.observer(its)

    def _policy(self, rows: int) -> AdaptiveGamma:
        """The adaptive-γ policy for calls of ``rows`` rows, kept per graph the call runs (1 row,
        or the batched graph's row count): the costs it learns are that graph's."""
        graph = 1 if rows == 1 else min(b for b in self.target.batched if b >= rows)
        if graph not in self.policies:
            self.policies[graph] = AdaptiveGamma(self.manifest.gamma, acceptance=self.acceptance)
        return self.policies[graph]

    def _draft(self, rows: list[Row], gammas: list[int]) -> list[int]:
        """Write each row's proposals at seq[L:L+k] (and its q rows); returns each k."""
        if self.drafters:
            return [self.drafters[r.slot].propose(r.seq, r.length, g, r.req.sampling, r.rng, r.q) if g else 0 for r, g in zip(rows, gammas)]
        gamma = self.manifest.gamma
        fused = [r for r, g in zip(rows, gammas) if g == gamma and r.length + gamma <= self.manifest.max_seq_len] if self.fused else []
        if fused:
            self._draft_fused(fused)
        done = {id(r) for r in fused}
        drafting = [(r, g) for r, g in zip(rows, gammas) if g and id(r) not in done]
        for j in range(max((g for _, g in drafting), default=0)):
            step = [(r, g) for r, g in drafting if g > j]
            feeds = [self._draft_feed(r, j) for r, _ in step]
            logits = self.draft([r.slot for r, _ in step], feeds)  # [n, S, V]
            for i, ((r, _), feed) in enumerate(zip(step, feeds)):
                self.draft.cache.slot(r.slot).append(len(feed))
                r.seq[r.length + j] = draw(logits[i, len(feed) - 1], r.req.sampling, r.rng, r.q[j])
        return gammas

    def _draft_fused(self, rows: list[Row]) -> None:
        """γ proposals for every row in one fused call (after one batched call feeding the rows
        whose draft slot is more than one token behind: those whose last call accepted all)."""
        feeds = [(r, self._draft_feed(r, 0)[:-1]) for r in rows]  # all the slot has not seen but the last token
        behind = [(r, f) for r, f in feeds if len(f)]
        if behind:
            self.draft([r.slot for r, _ in behind], [f for _, f in behind])
            for r, f in behind:
                self.draft.cache.slot(r.slot).append(len(f))
        size = 1 if len(rows) == 1 else min(b for b in self.target.batched if b >= len(rows))
        greedy = all(r.req.sampling.greedy for r in rows)
        runner = self.fused.get((size, greedy)) or self.fused[size, False]
        tokens = runner.run([r.slot for r in rows], [r.seq[r.length - 1] for r in rows], [r.req.sampling for r in rows], [r.rng for r in rows])
        gamma = runner.gamma
        self.draft.calls += gamma  # steps, as the drafters count them
        for i, r in enumerate(rows):
            r.seq[r.length : r.length + gamma] = tokens[i]
            self.draft.cache.slot(r.slot).append(gamma)  # rows for seq[L-1] and the first γ - 1 proposals
            if runner.sampling and not r.req.sampling.greedy:
                r.q[:gamma] = runner.probs[i]

    def _draft_feed(self, r: Row, j: int) -> np.ndarray:
        """What the draft model is fed at draft step j: the tokens its slot has not seen up to
        the last proposal (a long backlog after plain steps is caught up alone first)."""
        view, end = self.draft.cache.slot(r.slot), r.length + j
        if end - view.length > self.manifest.k:
            self.draft.one(r.slot, r.seq[view.length : end - 1])
            view.append(end - 1 - view.length)
        return r.seq[view.length : end]

    def _commit(self, r: Row, k: int, n: int, token: int) -> None:
        self.target.cache.slot(r.slot).append(n + 1)  # rows for seq[L-1] and x_1..x_n
        r.seq[r.length + n] = token
        if self.draft:
            view = self.draft.cache.slot(r.slot)
            view.rewind_to(min(view.length, r.length + n))
        else:
            self.drafters[r.slot].commit(r.seq, r.length, n)

    def _emit(self, r: Row, n: int) -> None:
        emitted, stopped = clip(r.seq[r.length : r.length + n + 1], r.left, r.req.stop)
        r.length, r.left = r.length + n + 1, r.left - len(emitted)
        stats = r.handle.stats
        r.handle._push(emitted)
        stats.new_tokens += len(emitted)
        stats.total_seconds = clock() - r.handle.start_time
        if stopped or r.left == 0:
            self._free(r, "eos" if stopped else "length")

    def _free(self, r: Row, reason: str, error: BaseException | None = None) -> None:
        self.rows.pop(r.slot, None)
        r.handle.stats.total_seconds = clock() - r.handle.start_time
        r.handle._finish(reason, error)

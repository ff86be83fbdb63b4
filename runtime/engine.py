"""The engine core: slots, the step plan, one speculative step, and emission, for one request or many.

    Engine(bundle, slots)
      target, draft   an Executor per model (engines/executor.py), ``slots`` KV slots each
      proposer        drafts for every row (runtime/proposers.py)
      start(req, sink, slot)   a request takes a slot: caches emptied (its source is encoded by the next step)
      step()                   cancelled rows leave; new sources encoded, together; schedule -> feed prompt chunks -> one
                               ``speculative_step`` over the decoding rows -> adapt γ -> emit

Two drivers step it: ``BatchEngine`` (runtime/batch.py) from its own thread with a queue, and
``SpeculativeDecoder`` (runtime/decoder.py), one slot stepped on the caller's thread.
Emission clips each row's accepted tokens to its budget and at its first stop token, pushes
them to the row's ``Handle``, and frees the slot when the request ends.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Callable

import numpy as np

from specdec.engines.executor import Executor
from specdec.errors import ConfigError
from specdec.manifest import Manifest
from specdec.runtime.adaptive import Acceptance, AdaptiveGamma
from specdec.runtime.drafters import make_proposer, models_for, needs_draft_model
from specdec.runtime.handles import Handle
from specdec.runtime.request import Request
from specdec.runtime.stats import Iteration
from specdec.runtime.logprobs import score
from specdec.runtime.row import Row
from specdec.runtime.step import schedule, speculative_step

clock = time.perf_counter


def clip(tokens: np.ndarray, budget: int, stop: frozenset[int]) -> tuple[list[int], bool]:
    """What one iteration emits of its ``tokens``: at most ``budget``, ending at the first stop
    token (kept); and whether a stop token ended them."""
    out = tokens[:budget].tolist()
    for j, tok in enumerate(out):
        if tok in stop:
            return out[: j + 1], True
    return out, False


def same_source(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    """Whether two requests' sources are the same (decoder-only requests have none: the same)."""
    return (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))


TENANT = "tenant:"  # the prefix of a salt the server derived from an API key (specdec serve --isolate-tenants)


def salt_class(salt: str | None) -> str:
    """The metrics class of a cache salt, never the salt itself: "none", "tenant" (the server's,
    from an API key) or "request" (the client's own ``cache_salt``)."""
    return "none" if salt is None else "tenant" if salt.startswith(TENANT) else "request"


class Engine:
    """``slots`` requests in flight over one bundle's sessions (``sessions``: graph name -> session).

    ``rows``: the most rows decoded together (default: ``slots``; ``reuse`` may keep more cache
    slots than that). ``reuse``: a request may keep the prefix of its prompt that its slot holds
    (``start``). ``prefill_chunk``: prompt tokens a joining row feeds per step (None: the whole prompt at
    once, as one request alone does); a chunk runs alone through the batch-1 graphs, so a long
    prompt stalls the rows in flight for one chunk per step. ``observer``, when set, is called
    after each step with one ``Iteration`` per decoded row (what a metrics exporter counts).
    """

    def __init__(self, bundle: Path, manifest: Manifest, sessions: dict, drafter, slots: int = 1, provider: str = "cpu",
                 prefill_chunk: int | None = None, reuse: bool = False, rows: int | None = None, draft_provider: str | None = None):  # fmt: skip
        self.manifest, self.slots, self.prefill_chunk = manifest, slots, prefill_chunk
        self.reuse = reuse
        self.target = Executor(bundle, manifest, "target", sessions, provider, slots, prefill_chunk, rows)
        drafting = draft_provider or provider  # the draft model's and the head's (the sessions were opened there)
        self.draft = Executor(bundle, manifest, "draft", sessions, drafting, slots, prefill_chunk, rows) if needs_draft_model(drafter) else None
        self.head = Executor(bundle, manifest, "head", sessions, drafting, slots) if "head" in models_for(drafter) else None
        self.proposer = make_proposer(drafter, bundle, manifest, self.draft, slots, self.target, self.head)
        if getattr(self.proposer, "tree", False) and self.target.tree_runner is None:
            raise ConfigError(f"drafter {self.proposer.name!r} verifies trees; load the bundle with it (its tree graph's session is opened then)")
        self.models = (self.target, self.draft) if self.draft else (self.target,)
        self.seqs = np.zeros((slots, manifest.max_seq_len), dtype=np.int64)  # [slots, MAX]
        self.qs = np.zeros((slots, manifest.gamma, manifest.vocab_size), dtype=np.float64)  # [slots, γ, V]
        self.rows: dict[int, Row] = {}  # slot -> row in flight
        self.policies: dict[tuple, AdaptiveGamma] = {}  # (graph rows, sampling, lenience) -> adaptive γ
        self.acceptances: dict[tuple, Acceptance] = {}  # (sampling, lenience) -> α, shared across graph sizes
        self.occupancy: Counter = Counter()  # decoding rows per step -> steps
        self.observer: Callable[[list[Iteration]], None] | None = None
        self.shared_tokens = 0  # prompt tokens copied from a row in flight with the same prompt
        # Prefix reuse: a slot keeps its KV rows and tokens (seqs[slot]) when its request ends
        self.last_used = [-1] * slots  # per slot, the start count when a request last took it (least recently used: lowest)
        # An encoder-decoder's rows depend on its source too: per slot, the source whose cross K/V every model's slot holds
        self.sources: list[np.ndarray | None] = [None] * slots
        self.pending: dict[int, np.ndarray] = {}  # slot -> the source it waits for (started since the last step)
        self.starts = 0
        self.prefix_queries = self.prefix_hits = self.evictions = 0  # prompt tokens asked, prompt tokens reused; slots overwritten
        self.salts: list[str | None] = [None] * slots  # per slot, the cache salt of the request whose KV rows it holds
        self.by_salt = {c: [0, 0] for c in ("none", "request", "tenant")}  # salt class -> [prompt tokens asked, reused]
        self.synthetic: float | None = None  # benchmarks only (specdec.bench.synthetic): outputs are then NOT the target's

    def free_slot(self) -> int | None:
        return next((s for s in range(self.slots) if s not in self.rows), None)

    def held(self, slot: int) -> int:
        """How many of seqs[slot]'s tokens every model's cache in the slot still holds."""
        return min(model.length(slot) for model in self.models)

    def reusable(self, req: Request, slot: int) -> int:
        """Rows of ``slot`` that ``req`` can keep: the tokens its prompt shares with what the slot
        holds, short of the prompt's last token (fed by the first decoding call)."""
        if req.params.prompt_logprobs is not None or not same_source(req.source, self.sources[slot]):  # prompt logprobs come from feeding it
            return 0
        if req.params.cache_salt != self.salts[slot]:  # another tenant's rows: never reused, so never faster
            return 0
        n = min(self.held(slot), len(req.prompt) - 1)
        diff = np.flatnonzero(self.seqs[slot, :n] != req.prompt[:n])
        return int(diff[0]) if diff.size else n

    def slot_for(self, req: Request) -> int | None:
        """A free slot for ``req``: with reuse, the one holding the longest prefix of its prompt,
        else the least recently used (what it held is evicted); None when every slot is taken."""
        free = [s for s in range(self.slots) if s not in self.rows]
        if not free:
            return None
        lru = min(free, key=lambda s: self.last_used[s])
        if not self.reuse:
            return lru
        best = max(free, key=lambda s: (self.reusable(req, s), -self.last_used[s]))
        return best if self.reusable(req, best) else lru

    def start(self, req: Request, sink: Handle, slot: int, reuse: bool | None = None) -> Row:
        """Give ``req`` the slot: caches emptied, or with ``reuse`` (default: the engine's) rolled
        back to the prefix of its prompt they hold; an encoder-decoder's source encoded by each
        model (its time counts as prefill); the rest of the prompt is fed by the next steps."""
        t0, L = clock(), len(req.prompt)
        use = self.reuse if reuse is None else reuse
        keep = self.reusable(req, slot) if use else 0
        if use and not keep and self.held(slot) and self.last_used[slot] >= 0:
            self.evictions += 1  # another prefix was held here
        self.prefix_queries += L
        self.prefix_hits += keep
        counts = self.by_salt[salt_class(req.params.cache_salt)]
        counts[0], counts[1] = counts[0] + L, counts[1] + keep
        self.salts[slot] = req.params.cache_salt
        self.starts += 1
        self.last_used[slot] = self.starts
        for model in self.models:
            model.rewind_to(slot, keep)  # 0: emptied; else the prompt's first ``keep`` rows are kept
        if req.source is not None and not same_source(req.source, self.sources[slot]):
            self.sources[slot] = None  # until the next step encodes or copies it (_take_sources)
            self.pending[slot] = req.source
        seq = self.seqs[slot]
        seq[:L] = req.prompt
        sink.start_time = t0
        sink.stats.synthetic = self.synthetic
        row = self.rows[slot] = Row(req, sink, slot, seq, self.qs[slot], np.random.default_rng(req.seed), L, req.max_new_tokens, grammar=req.new_grammar())
        sink.stats.prefill_seconds += clock() - t0
        return row

    def step(self) -> None:
        """One iteration for every row in flight (see the module docstring)."""
        for row in [r for r in self.rows.values() if r.sink.cancelled.is_set()]:
            self.free(row, "cancelled")
        if self.pending:
            self._take_sources()
        plan = schedule(list(self.rows.values()), self.target.length, self.prefill_chunk, self._width)
        for slot, start, stop in plan.prefill:
            r = self.rows[slot]
            if not any(self._share(src, r, start, stop) for src in self._donors(r)):
                self._prefill(r, start, stop)
        rows = [self.rows[s] for s, _ in plan.decode]
        for r in rows:
            if not r.ready:
                r.ready = True
                self.proposer.start(r)
        if not rows:
            return
        t0 = clock()
        its = speculative_step(rows, [g for _, g in plan.decode], self.proposer, self.target, self.synthetic)
        self.occupancy[len(rows)] += 1
        for r, it in zip(rows, its):
            r.stats.record(it)
            self._emit(r, it.accepted)
        if any(r.req.adaptive for r in rows):  # the iteration's whole time: drafting, the call, acceptance, emission
            self._policy(len(rows), rows).observe([i.drafted for i in its], [i.accepted for i in its], clock() - t0)
            for r, i in zip(rows, its):
                if r.acceptance is not None and i.drafted:
                    r.acceptance.observe(i.drafted, i.accepted)
        if self.observer:
            self.observer(its)

    def _width(self, rows: list[Row]) -> int:
        """γ for the adaptive ones of a step's decoding ``rows``: what maximizes the call's tokens
        per second over the rows' own α (a row joining starts from its setting's pooled α)."""
        policy = self._policy(len(rows), rows)
        adaptive = [r for r in rows if r.req.adaptive]
        for r in adaptive:
            if r.acceptance is None:
                r.acceptance = policy.acceptance.fork()
        return policy.next([r.acceptance for r in adaptive])

    def _policy(self, rows: int, among: list[Row]) -> AdaptiveGamma:
        """The adaptive-γ policy of calls of ``rows`` rows (costs are the graph's that runs them)
        at the sampling setting of the step's first adaptive row (α depends on it). Policies
        live as long as the engine: a request starts from what earlier ones learned."""
        req = next(r.req for r in among if r.req.adaptive)
        setting = (req.sampling, req.lenience)
        key = (self.target.rows_for(rows), *setting)
        if key not in self.policies:
            acceptance = self.acceptances.setdefault(setting, Acceptance())
            self.policies[key] = AdaptiveGamma(self.manifest.gamma, acceptance=acceptance)
        return self.policies[key]

    def _prefill(self, r: Row, start: int, stop: int) -> None:
        """Feed seq[start:stop] of a joining row to every model's slot (batch-1 graphs); with
        prompt logprobs asked, the target's logits there score seq[start + 1 : stop + 1]."""
        t0 = clock()
        for model in self.models:
            logits = model.forward([r.slot], [r.seq[start:stop]])
            if model is self.target and r.sink.prompt_logprobs is not None:
                r.sink.prompt_logprobs += score(logits[0, : stop - start], r.seq[start + 1 : stop + 1], r.req.params.prompt_logprobs)
            model.commit(r.slot, stop - start)
        r.stats.prefill_seconds += clock() - t0

    def _take_sources(self) -> None:
        """Every slot started since the last step gets its source's cross K/V: copied from a
        slot that holds it (n choices of one source, a source sent again), else encoded, the
        distinct new sources in one batched encoder call per model (the time: each row's prefill)."""
        t0 = clock()
        fresh: dict[int, np.ndarray] = {}  # slot -> a distinct new source it encodes
        copies: list[tuple[int, int]] = []  # (from, to), after the encoding
        for slot, source in self.pending.items():
            held = next((s for s in range(self.slots) if same_source(source, self.sources[s])), None)
            held = held if held is not None else next((s for s, src in fresh.items() if same_source(source, src)), None)
            if held is None:
                fresh[slot] = source
            else:
                copies.append((held, slot))
        for model in self.models:
            model.encode_many(list(fresh), list(fresh.values()))
            for src, dst in copies:
                model.share_source(src, dst)
        for slot, source in self.pending.items():
            self.sources[slot] = source
            if slot in self.rows:
                self.rows[slot].stats.prefill_seconds += (clock() - t0) / len(self.pending)
        self.pending.clear()

    def _donors(self, r: Row) -> list[Row]:
        """The rows in flight with ``r``'s very prompt and cache salt (the n choices of one prompt; of one source
        too, for an encoder-decoder): they feed it in the same chunks, so the KV rows they hold
        are the ones ``r`` would compute, bit for bit."""
        return [d for d in self.rows.values() if d is not r and same_source(d.req.source, r.req.source) and d.req.params.cache_salt == r.req.params.cache_salt
                and np.array_equal(d.req.prompt, r.req.prompt)]  # fmt: skip

    def _share(self, src: Row, r: Row, start: int, stop: int) -> bool:
        """Give row ``r`` the prompt rows [start, stop) that ``src`` has fed already (n choices of
        one prompt prefill it once): every model's KV rows are copied, as are the prompt logprobs.
        False where they cannot be (``src`` is not that far, other prompt-logprob settings, a
        device cache): the row is then fed."""
        if r.req.params.prompt_logprobs != src.req.params.prompt_logprobs or self.target.length(src.slot) < stop:
            return False
        t0 = clock()
        if not all(model.copy(src.slot, r.slot, stop) for model in self.models):
            for model in self.models:
                model.rewind_to(r.slot, start)  # a model that copied forgets it: the row is fed whole
            return False
        if r.sink.prompt_logprobs is not None:
            r.sink.prompt_logprobs += src.sink.prompt_logprobs[start + 1 : stop + 1]
        self.shared_tokens += stop - start
        self.prefix_hits += stop - start
        self.by_salt[salt_class(r.req.params.cache_salt)][1] += stop - start
        r.stats.prefill_seconds += clock() - t0
        return True

    def _emit(self, r: Row, n: int) -> None:
        """Push what the row's iteration kept (clipped to its budget and at a stop token)."""
        emitted, stopped = clip(r.seq[r.length : r.length + n + 1], r.left, r.req.stop)
        r.length, r.left = r.length + n + 1, r.left - len(emitted)
        r.stats.new_tokens += len(emitted)
        r.stats.total_seconds = clock() - r.sink.start_time
        r.sink.push(emitted, r.scored[: len(emitted)] if r.scored is not None else None)
        if stopped or r.left == 0:
            self.free(r, "eos" if stopped else "length")

    def leave(self, slot: int) -> None:
        """Whatever row holds ``slot`` leaves it, its handle untouched (a closed stream, a failed start)."""
        self.rows.pop(slot, None)

    def free(self, r: Row, reason: str | None, error: BaseException | None = None) -> None:
        """The row leaves its slot; its handle ends with ``reason`` (and ``error``)."""
        self.rows.pop(r.slot, None)
        r.stats.total_seconds = clock() - r.sink.start_time
        if r.grammar is not None:
            r.stats.grammar_seconds = r.grammar.seconds
        r.sink.finish(reason, error)

"""One model's execution: provider, sessions, the slot KV cache and the choice of graph, in one owner.

    Executor (target or draft)
      cache     SlotCache: per slot a KVCache view, plus a scratch slot; allocated at load
      forward(slots, feeds) -> logits [n, S, V]
                  with a rows graph (export/rows.py; an engine of several slots): every call,
                          1 row included, runs its smallest body of >= n rows, one session
                  else 1 row:  the batch-1 graph over that slot's view (its fixed-length
                          binding when the feed fills it: the target's K-token verify, a
                          1-token step); n rows: the smallest batched graph holding n rows
      fused(rows, greedy)  the draft's γ-steps-in-one-call runner for a call of that many rows
      encode(slot, source) an encoder-decoder's encoder writes the slot's cross K/V
      encode_many(slots, sources)  several sources in one batched encoder call (padded, masked)
      KV manager: length / commit / rewind_to / reset per slot (the SlotCache, which also
                  compacts a tree's accepted rows: keep)

The device is a value given at load (``provider``), never a literal: the KV buffers live on
it and every runner binds them there. Host buffers (ids, positions, logits) stay on the host:
acceptance reads the logits in NumPy.

Invariant: rows [0, length(slot)) of a slot are committed; a call writes its rows at
[length, length + S) in place and the caller keeps some with ``commit`` (the rest are never
read: every call overwrites from the committed length), so a rollback is a length change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import onnxruntime as ort

from specdec.engines.batch import BatchRunner, SlotCache, slot_sources
from specdec.engines.fused import FusedRunner
from specdec.engines.kv import KVCache
from specdec.engines.move import RowMover
from specdec.engines.captured import CapturedBatchRunner, CapturedRunner
from specdec.engines.ort import BatchEncoder, EncoderRunner, GraphRunner, TreeRunner, fixed_tokens, fused_graph, runner_for
from specdec.engines.sessions import CAPTURE, DEVICE, open_session
from specdec.engines.threads import ThreadPolicy
from specdec.errors import ConfigError, EngineError
from specdec.manifest import FUSED_ROLES, Manifest


def batched_sizes(manifest: Manifest, slots: int) -> tuple[int, ...]:
    """The batched graph sizes an engine of ``slots`` rows needs: ascending, up to the first that
    holds them all (none for one slot). A ConfigError if the bundle lacks one that large."""
    if slots == 1:
        return ()
    sizes = tuple(b for b in manifest.batch_sizes() if b < slots) + tuple(b for b in manifest.batch_sizes() if b >= slots)[:1]
    if max(sizes, default=0) < slots:
        raise ConfigError(f"bundle has no batched graph for {slots} rows; re-export with --max-batch {slots}")
    return sizes


# Providers the fused draft graphs run on. Their attention's total length is computed in the
# graph from seqlens_k (export/fused.py), which CUDA's GroupQueryAttention reads wrong: on the
# H100 the same draft accepted 0.01 fused against 0.10 in steps (docs/gpu.md). On CUDA the draft
# model runs its step graphs; outputs stay exact either way, since the target verifies.
FUSED_PROVIDERS = ("cpu",)


def graph_names(manifest: Manifest, models: Sequence[str], slots: int, fused: bool, tree: bool = False) -> list[str]:
    """Every graph an engine of ``slots`` rows opens a session for: per model, for several
    slots its rows graph alone (one session for every row count, 1 included: the weights are
    packed once), else its batch-1 dynamic graph (which also runs its fixed-length calls), its
    encoder and an older bundle's batched graphs; the draft's fused graphs; and with ``tree`` the
    target's tree verify graph (a session of its own: only for a tree drafter)."""
    if "draft" in models and manifest.draft is None:
        raise ConfigError("this drafter runs the draft model, which this bundle lacks (its drafter is a feature head, an EAGLE-3 head given as "
                          "--draft); use --drafter feature, feature-lookup or a model-free one (lookup, ngram)")
    if "head" in models and manifest.head is None:
        raise ConfigError("the feature drafter needs the bundle's feature head, which this bundle lacks; train one with specdec train-drafter BUNDLE --corpus DIR")
    if tree and not any(g.role == "tree" for g in manifest.graphs.values()):
        raise ConfigError("a tree drafter needs the target's tree verify graph, which this bundle lacks; re-export it with --tree-nodes N (e.g. 8)")
    names = [manifest.graph("target", "tree")[0]] if tree else []
    if tree and any(g.role == "move" for g in manifest.graphs.values()):  # a device cache's row moves (export/kv_move.py)
        names.append(manifest.graph("target", "move")[0])
    for model in models:
        if slots > 1 and (rows := manifest.rows_graph(model)):
            batched_sizes(manifest, slots)  # refuses an engine larger than the bundle's rows
            names.append(rows[0])
            if manifest.seq2seq:  # the batched encoder (1..B sources a call: its weights packed once), else an older bundle's batch-1 one
                names.append(batched_encoder(manifest, model) or manifest.graph(model, "encoder")[0])
            continue
        names.append(manifest.graph(model, "dynamic")[0])
        if manifest.seq2seq:
            names.append(manifest.graph(model, "encoder")[0])
        if model != "head":  # the head runs one row per call: no batched head graph yet
            names += [manifest.graph(model, "dynamic", batch=b)[0] for b in batched_sizes(manifest, slots)]
    if fused and "draft" in models:
        for rows in (1, *batched_sizes(manifest, slots)):
            names += [found[0] for role in FUSED_ROLES if (found := fused_graph(manifest, role, rows))]
    return names


def batched_encoder(manifest: Manifest, model: str) -> str | None:
    """The name of ``model``'s batched encoder graph (export/seq2seq.py), or None."""
    return next((n for n, g in manifest.graphs.items() if g.model == model and g.role == "encoder" and g.batch > 1), None)


def open_sessions(bundle: Path, manifest: Manifest, names: Sequence[str], provider: str, threads: ThreadPolicy,
                  draft_provider: str | None = None) -> dict[str, ort.InferenceSession]:  # fmt: skip
    """graph name -> session, each signature checked against the manifest (sessions are
    thread-safe and hold the weights; executors over them share them). ``draft_provider``: the
    drafting models' (the draft model, the feature head), where it is not the target's."""
    where = lambda g: provider if g.model == "target" or draft_provider is None else draft_provider  # noqa: E731
    return {name: open_session(bundle, name, manifest.graphs[name], where(manifest.graphs[name]), threads) for name in names}


class Executor:
    """One model ("target" or "draft") of a bundle over ``slots`` cache slots."""

    def __init__(self, bundle: Path, manifest: Manifest, model: str, sessions: dict, provider: str = "cpu", slots: int = 1,
                 single: int | None = None, rows: int | None = None):  # fmt: skip
        """``single``: the most tokens a lone row feeds in a call (a prompt chunk; None: any
        length), for a rows graph's 1-row body. ``rows``: the most rows a call runs (default:
        ``slots``; fewer when the engine keeps more cache slots than it decodes rows)."""
        rows = slots if rows is None else rows
        m, spec = manifest, getattr(manifest, model)
        self.model, self.device, self.slots = model, DEVICE[provider], slots
        self.cache = SlotCache(spec.num_layers, spec.num_kv_heads, m.max_seq_len, spec.head_dim, m.dtype, slots, self.device)
        view = self.cache.slot(0)
        merged = m.rows_graph(model) if rows > 1 and model != "head" else None  # rows, not slots (max_batch=1 with more cache slots: batch-1 graphs); the head runs one row per call
        self.batched: dict[int, BatchRunner] = {}  # B -> the runner whose graph runs calls of B rows
        self.dynamic = self.static = self.captured = None  # batch-1 runners: any length; the fixed length; captured, per length
        if m.seq2seq and self.device != "cpu":
            raise EngineError(f"encoder-decoder bundles run on the CPU provider only so far; {bundle} needs provider='cpu'")
        # an encoder-decoder's cross K/V per slot (the scratch slot's last), written by its encoder once per request
        self.cross = slot_sources(spec.num_layers, spec.num_heads, m.max_source_len, spec.head_dim, m.dtype, slots) if m.seq2seq else None
        if merged:
            runner = BatchRunner(sessions[merged[0]], *merged, self.cache, m.k, single or m.max_seq_len, cross=self.cross)
            self.batched = {b: runner for b in runner.sizes if b <= self.rows_cap(runner.sizes, rows)}
        else:
            name, g = m.graph(model, "dynamic")
            self.dynamic: GraphRunner = runner_for(bundle, name, g, view, session=sessions[name])  # any length
            # captured CUDA graphs: one runner per call length up to the verify's (made at its first call),
            # so a smaller γ (adaptive, a request's own) replays too; longer calls (prompt chunks) run uncaptured
            self.captured: dict[int, CapturedRunner] | None = {} if provider in CAPTURE else None
            self._capture = (sessions[name], name, g, m.k)  # the longest captured call: a verify of γ + 1 (a draft catching up feeds as many)
            if self.captured is None:
                self.static = runner_for(bundle, name, g, view, session=sessions[name], tokens=fixed_tokens(m, model))
            for b in batched_sizes(m, rows) if model != "head" else ():  # per-size graphs (no If nodes): captured on a capturing provider
                name, g = m.graph(model, "dynamic", batch=b)
                self.batched[b] = (BatchRunner if self.captured is None else CapturedBatchRunner)(sessions[name], name, g, self.cache, m.k)
        self.fused_runners: dict[tuple[int, bool], FusedRunner] = {}  # (graph rows, argmax only) -> runner
        for rows in (1, *(b for b in self.batched if b > 1)):
            for role in FUSED_ROLES:
                found = fused_graph(m, role, rows)
                if model == "draft" and found and found[0] in sessions:
                    self.fused_runners[rows, role == "fused_greedy"] = FusedRunner(sessions[found[0]], *found, self.cache.slot, self.cache.scratch)
        self.encoder = self.batch_encoder = None  # an encoder-decoder's: one source a call; 1..B sources a call
        if m.seq2seq and merged and (name := batched_encoder(m, model)) in sessions:
            self.batch_encoder = BatchEncoder(sessions[name], name, m.graphs[name], min(m.graphs[name].batch, slots), m.max_source_len)
        elif m.seq2seq:
            name, g = m.graph(model, "encoder")
            self.encoder = EncoderRunner(sessions[name], name, g, self.cross[0])
        self.tree_runner, self.mover = self._tree(m, model, sessions, provider)
        self._cross_slot = {id(self.dynamic): -1, id(self.static): -1}  # slot whose cross K/V each batch-1 runner reads
        # The target's features for a feature drafter (export/features.py): per slot, row t + 1
        # holds the feature of position t (row 0 stays zero: what the head reads at position 0).
        # Written by every call at the rows it feeds, like the KV rows; ``keep`` compacts them too.
        dyn = merged[1] if merged else m.graph(model, "dynamic")[1]
        width = next((t.shape[-1] for t in dyn.outputs if t.name == dyn.io.features), 0) if model == "target" else 0
        self.store = np.zeros((slots + 1, m.max_seq_len + 1, width), dtype=np.float32) if width else None  # [slots+1, MAX+1, d]
        self.features: np.ndarray | None = None  # [n, d]: the last batch-1 call's features (a view)
        self.calls = 0  # forward calls (the fused drafter adds its γ steps)
        self.encodes = 0  # encoder calls (an encoder-decoder's sources)

    def _tree(self, m: Manifest, model: str, sessions: dict, provider: str) -> tuple[TreeRunner | None, RowMover | None]:
        """A tree drafter's verify runner (None: not opened), and on a device cache the mover of
        its accepted rows (the bundle's move graph; KVCache.keep moves them on the host)."""
        found = [(n, g) for n, g in m.graphs.items() if g.model == model and g.role == "tree" and n in sessions]
        tree = TreeRunner(sessions[found[0][0]], *found[0], self.cache.slot(0)) if found else None
        moves = [(n, g) for n, g in m.graphs.items() if g.model == model and g.role == "move" and n in sessions]
        mover = RowMover(sessions[moves[0][0]], *moves[0]) if moves and self.device != "cpu" else None
        if tree is not None and self.device != "cpu" and mover is None:
            raise EngineError(f"tree drafters move KV rows, which this bundle does on host buffers only (it predates the move graph); "
                              f"re-export it with --tree-nodes, or on provider={provider!r} use a chain drafter (model, feature, feature-lookup, lookup, ...)")
        return tree, mover

    # -- running ----------------------------------------------------------------------------

    def forward(self, slots: Sequence[int], feeds: Sequence[np.ndarray], context: np.ndarray | None = None) -> np.ndarray:
        """Logits [n, S, V] for n slots' feeds (S: the longest; a row's logits past its feed are
        padding), their KV rows written at each slot's committed length. A view the next call
        overwrites. Committing is the caller's (``commit``). ``context`` [S, d]: a feature head's
        input rows (one slot)."""
        self.calls += 1
        if len(slots) == 1 and self.dynamic is not None:
            return self._one(slots[0], feeds[0], context)[None]
        runner = self.batched[self.rows_for(len(slots))]
        logits = runner.run(slots, feeds)
        if runner.features is not None and len(slots) == 1:
            self.features = runner.features[0, : len(feeds[0])]
        if self.store is not None:
            for i, (s, feed) in enumerate(zip(slots, feeds)):
                start = self.cache.length(s)
                self.store[s, start + 1 : start + 1 + len(feed)] = runner.features[i, : len(feed)]
        return logits

    def feed_limit(self, rows: int) -> int | None:
        """The most tokens one row feeds in a call of ``rows`` rows (None: any length)."""
        if rows == 1 and self.dynamic is not None:
            return None
        runner = self.batched[self.rows_for(rows)]
        return runner.single if rows == 1 and runner.single else runner.max_tokens

    @staticmethod
    def rows_cap(sizes: Sequence[int], slots: int) -> int:
        """The largest B an engine of ``slots`` rows runs: the smallest size holding them all."""
        return next(b for b in sizes if b >= slots)

    def rows_for(self, n: int) -> int:
        """The graph row count a call of ``n`` rows runs (1: the batch-1 graphs)."""
        return 1 if n == 1 and self.dynamic is not None else min(b for b in self.batched if b >= n)

    def _one(self, slot: int, feed: np.ndarray, context: np.ndarray | None = None) -> np.ndarray:
        runner = self._captured(len(feed)) if self.captured is not None else self.static if len(feed) == self.static.capacity else self.dynamic
        view = self.cache.slot(slot)
        if runner.cache is not view:
            runner.bind_cache(view)
        if self.encoder is not None and self._cross_slot[id(runner)] != slot:
            runner.bind_cross(self.cross[slot])
            self._cross_slot[id(runner)] = slot
        logits = runner.run(feed, context)
        if runner.features is not None:
            n = len(feed)
            self.features = runner.features[0, :n]
            if self.store is not None:
                self.store[slot, view.length + 1 : view.length + 1 + n] = self.features
        return logits

    def _captured(self, n: int):
        """The runner of a call of ``n`` tokens on a capturing provider: the captured one of that
        length (made now if new) up to the verify's length, else the uncaptured dynamic one."""
        session, name, g, longest = self._capture
        if n > longest:
            return self.dynamic
        if n not in self.captured:
            self.captured[n] = CapturedRunner(session, name, g, self.dynamic.cache, n)
        return self.captured[n]

    def tree(self, slot: int, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """Logits [n, V] of a tree's n nodes over ``slot`` (engines/ort.py TreeRunner); node i's
        KV at the slot's length + i. Keeping the accepted path is the caller's (``keep``)."""
        self.calls += 1
        view = self.cache.slot(slot)
        if self.tree_runner.cache is not view:
            self.tree_runner.bind_cache(view)
        logits = self.tree_runner.run_tree(tokens, parents)
        if self.store is not None:
            self.store[slot, view.length + 1 : view.length + 1 + len(tokens)] = self.tree_runner.features[0, : len(tokens)]
        return logits

    def fused(self, rows: int, greedy: bool) -> FusedRunner | None:
        """The fused draft runner for a call of ``rows`` rows (the argmax-only variant when all
        are greedy and the bundle has it), or None."""
        size = self.rows_for(rows)
        return (self.fused_runners.get((size, True)) if greedy else None) or self.fused_runners.get((size, False))

    def encode(self, slot: int, source: np.ndarray) -> None:
        """Run the encoder on a request's source [N] into ``slot``'s cross K/V."""
        self.encode_many([slot], [source])

    def encode_many(self, slots: Sequence[int], sources: Sequence[np.ndarray]) -> None:
        """Each of ``slots`` gets its source's cross K/V: several in one batched encoder call
        when the bundle has one (padded and masked), else one call each."""
        step = self.batch_encoder.rows if self.batch_encoder is not None else 1
        for i in range(0, len(slots), step):
            group, srcs = slots[i : i + step], sources[i : i + step]
            self.encodes += 1
            if self.batch_encoder is not None:
                self.batch_encoder.run(srcs, [self.cross[s] for s in group])
            else:
                self.encoder.cross = self.cross[group[0]]
                self.encoder.run(srcs[0])
            for s in group:
                self._unbind_cross(s)

    def share_source(self, src: int, dst: int) -> None:
        """Slot ``dst`` takes ``src``'s encoded source (its cross K/V), as ``encode`` would write it."""
        self.cross[dst].copy_from(self.cross[src])
        self._unbind_cross(dst)

    def _unbind_cross(self, slot: int) -> None:
        """A batch-1 runner bound to ``slot``'s cross K/V re-binds on its next call (the source length sets the shape)."""
        for key, bound in self._cross_slot.items():
            if bound == slot:
                self._cross_slot[key] = -1

    # -- the KV manager (engines/batch.py SlotCache) ----------------------------------------

    def slot(self, s: int) -> KVCache:
        return self.cache.slot(s)

    def length(self, s: int) -> int:
        return self.cache.length(s)

    def commit(self, s: int, n: int) -> None:
        self.cache.commit(s, n)

    def rewind_to(self, s: int, n: int) -> None:
        self.cache.rewind_to(s, n)

    def copy(self, src: int, dst: int, stop: int) -> bool:
        """Slot ``dst`` takes ``src``'s committed rows from its own length up to ``stop`` (the
        stored features too) instead of computing them; False where it cannot (``SlotCache.copy``)."""
        start = self.cache.length(dst)
        if not self.cache.copy(src, dst, stop):
            return False
        if self.store is not None:
            self.store[dst, start + 1 : stop + 1] = self.store[src, start + 1 : stop + 1]
        return True

    def keep(self, s: int, rows: Sequence[int]) -> None:
        """Commit rows at these positions (ascending, past the committed ones), moved into place
        (the stored features too)."""
        start = self.cache.length(s)
        if self.mover is not None:
            self.mover.keep(self.cache.slot(s), [r - start for r in rows])
        else:
            self.cache.keep(s, rows)
        if self.store is not None:
            for i, row in enumerate(rows):  # ascending and row >= start + i: never overwrites a row still to move
                self.store[s, start + 1 + i] = self.store[s, row + 1]

    def reset(self, s: int) -> None:
        self.cache.rewind_to(s, 0)

"""Drafters: what proposes the tokens the target verifies, one sequence at a time.

One small interface (``Drafter``). Every drafter works on its row's token buffer ``seq``
[MAX], where ``seq[:L]`` is committed (prompt + output) and proposals are written at
``seq[L:L+k]``:

    start(seq, L)                 a new request; seq[:L] is the prompt
    propose(seq, L, g, cfg, rng, q) -> k
                                  write k <= g tokens at seq[L:L+k]; when sampling, q[i] is the
                                  distribution token L+i was drawn from (one-hot for the
                                  deterministic drafters, which Algorithm 1 handles exactly)
    commit(seq, L, n)             the target kept n of them (seq[:L+n+1] is now committed)

The engine runs one drafter per slot behind ``proposers.PerRow``; the bundle's draft model is
a batched proposer of its own (``proposers.DraftModel``, registered here as "model" and
"model-steps"). Encoder-decoder requests: before ``start`` a drafter with a ``use_source(ids)``
method gets the request's source ids [N]; prompt lookup then copies from the source too (what
makes speculation pay for translation and summarization), the per-request bigram table counts
it, and the hierarchical drafter's lookup (``proposers.Hierarchical``) reads ``row.req.source``.

Drafters are registered by name (``register``; ``DRAFTERS`` maps a name to its factory,
whether it needs the bundle's draft model and whether it is batched). Both engines also take
any object with the ``Drafter`` interface, a user's own drafter included (docs "Writing a drafter").

Speculative sampling is exact for any q that truly is the distribution each token was drawn
from, so every drafter here keeps the target's output distribution:

- ``NgramDrafter``: a bigram ("ngram") or unigram ("unigram") table, the most frequent successor; table lookups,
  c ≈ 0 (paper §3.6, Table 3). The table comes from the bundle (``specdec-export
  --ngram-corpus``) or, without one, from each request's prompt.
- ``LookupDrafter``: prompt lookup, copying what followed the latest earlier occurrence of
  the last n tokens of prompt + output (§3.6, "copying from the prompt").
- ``proposers.Hierarchical`` ("hierarchical"): prompt lookup proposes tokens *for the draft
  model*, which checks them with one call and speculative sampling against its own q; built
  on ``proposers.DraftModel``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Protocol, runtime_checkable

import numpy as np

from specdec.errors import BundleError, ConfigError
from specdec.ngram_table import NgramTable
from specdec.runtime.lookup import lookup_chain, one_hot
from specdec.runtime.sampling import SamplingConfig


@runtime_checkable
class Drafter(Protocol):
    name: str  # shown in the stats
    calls: int  # proposal calls so far (draft-model steps for the model drafters: a fused call counts its γ)

    def start(self, seq: np.ndarray, length: int) -> None:
        """A new request: seq[:length] is its prompt; forget every earlier request."""
        ...

    def propose(self, seq: np.ndarray, length: int, gamma: int, cfg: SamplingConfig, rng: np.random.Generator, q: np.ndarray) -> int:
        """Write k <= gamma tokens at seq[length:length+k] and return k; unless ``cfg.greedy``,
        q[i] [V] must be the distribution token length+i was drawn from."""
        ...

    def commit(self, seq: np.ndarray, length: int, accepted: int) -> None:
        """seq[:length + accepted + 1] is now committed (the target's token included)."""
        ...


class LookupDrafter:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n = max_ngram
    down to min_ngram) in seq[:L] and propose up to ``max_tokens`` tokens that followed it.
    With a source (encoder-decoder requests, ``use_source``) the source is searched too, and
    the longer match wins (the decoder's own on a tie)."""

    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_tokens: int | None = None):
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise ConfigError(f"lookup n-gram sizes {min_ngram}..{max_ngram}: expected integers 1 <= min <= max")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ConfigError(f"lookup max_tokens={max_tokens!r}: expected an integer >= 1 or None (= gamma)")
        self.max_ngram, self.min_ngram, self.max_tokens = max_ngram, min_ngram, max_tokens
        self.source: np.ndarray | None = None  # [N] an encoder-decoder request's source ids
        self.calls = 0

    def use_source(self, source: np.ndarray) -> None:
        self.source = source

    def start(self, seq: np.ndarray, length: int) -> None:
        pass

    def propose(self, seq, length, gamma, cfg, rng, q) -> int:
        self.calls += 1
        limit = min(gamma, self.max_tokens or gamma)
        return lookup_chain(seq, length, limit, None if cfg.greedy else q, self.max_ngram, self.min_ngram, self.source)

    def commit(self, seq: np.ndarray, length: int, accepted: int) -> None:
        pass


class BigramCounts:
    """The same table as ``NgramTable.count``, kept up to date token by token (per request)."""

    def __init__(self, vocab: int):
        self.table = NgramTable(np.full((vocab,), -1, dtype=np.int64), 0)  # [V]
        self.pairs: dict[tuple[int, int], int] = {}
        self.best: dict[int, int] = {}  # prev -> count of its current successor
        self.unigrams: dict[int, int] = {}

    def add(self, ids: list[int], prev: int | None = None) -> None:
        """Count ``ids``, the first following ``prev`` (None: a fresh stream)."""
        succ = self.table.successor
        for tok in ids:
            c = self.unigrams[tok] = self.unigrams.get(tok, 0) + 1
            top = self.table.top
            if c > self.unigrams.get(top, 0) or (c == self.unigrams[top] and tok < top):
                self.table.top = tok
            if prev is not None:
                c = self.pairs[prev, tok] = self.pairs.get((prev, tok), 0) + 1
                if c > self.best.get(prev, 0) or (c == self.best[prev] and tok < succ[prev]):
                    succ[prev], self.best[prev] = tok, c
            prev = tok


class NgramDrafter:
    """Table 3's trivial drafters. order=2: follow the most frequent successor from the last
    token (falling back to the most frequent token); order=1: always the most frequent token.
    A corpus table (from the bundle) is used as is; without one, each request counts its
    prompt and then every token it commits."""

    def __init__(self, vocab: int, table: NgramTable | None = None, order: int = 2):
        if order not in (1, 2):
            raise ConfigError(f"n-gram order {order!r}: expected 1 (unigram) or 2 (bigram)")
        self.vocab, self.fixed, self.order = vocab, table, order
        self.name = "ngram" if order == 2 else "unigram"
        self.table = table
        self.counts: BigramCounts | None = None
        self.source: np.ndarray | None = None  # [N] an encoder-decoder request's source ids: counted too
        self.calls = 0

    def use_source(self, source: np.ndarray) -> None:
        self.source = source

    def start(self, seq: np.ndarray, length: int) -> None:
        if self.fixed is None:
            self.counts = BigramCounts(self.vocab)
            if self.source is not None:
                self.counts.add(self.source.tolist())
            self.counts.add(seq[:length].tolist())
            self.table = self.counts.table

    def propose(self, seq, length, gamma, cfg, rng, q) -> int:
        self.calls += 1
        succ, top = self.table.successor, self.table.top
        last = seq[length - 1]
        for i in range(gamma):
            nxt = succ[last] if self.order == 2 else -1
            last = seq[length + i] = top if nxt < 0 else nxt
        if not cfg.greedy:
            one_hot(q, seq[length : length + gamma])
        return gamma

    def commit(self, seq: np.ndarray, length: int, accepted: int) -> None:
        if self.counts is not None:
            self.counts.add(seq[length : length + accepted + 1].tolist(), int(seq[length - 1]))


class DrafterContext(NamedTuple):
    """What a drafter factory may use: the bundle, and with ``needs_draft_model`` the draft
    model: its ``Executor`` for a batched factory, one slot of it (``proposers.SlotModel``) for
    a per-sequence one."""

    bundle: Path
    manifest: object  # specdec.manifest.Manifest
    draft: object | None
    target: object | None = None  # the target's Executor (a feature drafter reads its features)
    head: object | None = None  # with ``needs_head``: the feature head's Executor


@dataclass(frozen=True)
class Registration:
    factory: Callable[[DrafterContext], object]
    needs_draft_model: bool  # the engine then loads the draft model's executor and feeds it prompts
    batched: bool = False  # the factory makes one ``proposers.Proposer`` for all slots, not a Drafter per slot
    tree: bool = False  # it proposes trees: the target verifies them with its tree graph (specdec-export --tree-nodes)
    needs_head: bool = False  # the engine loads the bundle's feature head (specdec train-drafter)


DRAFTERS: dict[str, Registration] = {}


def register(name: str, needs_draft_model: bool = False, batched: bool = False, tree: bool = False, needs_head: bool = False) -> Callable:
    """Decorator: make ``factory(ctx)`` available as ``drafter=name``: a ``Drafter`` per slot, or
    with ``batched`` one ``Proposer`` for all slots."""

    def add(factory: Callable[[DrafterContext], object]) -> Callable[[DrafterContext], object]:
        DRAFTERS[name] = Registration(factory, needs_draft_model, batched, tree, needs_head)
        return factory

    return add


def bundle_table(ctx: DrafterContext) -> NgramTable | None:
    """The bundle's corpus n-gram table (``specdec-export --ngram-corpus``), if it has one."""
    m = ctx.manifest
    if not m.ngram:
        return None
    from specdec.manifest import inside

    return NgramTable.load(inside(ctx.bundle, m.ngram["file"]), m.vocab_size)


def _draft_model(fused: bool) -> Callable[[DrafterContext], object]:
    from specdec.runtime.proposers import DraftModel

    return lambda ctx: DraftModel(ctx.draft, fused)


register("model", needs_draft_model=True, batched=True)(_draft_model(fused=True))
register("model-steps", needs_draft_model=True, batched=True)(_draft_model(fused=False))  # one call per draft token
register("hierarchical", needs_draft_model=True, batched=True)(lambda ctx: _hierarchical(ctx))
register("feature", batched=True, needs_head=True)(lambda ctx: _feature(ctx))
register("feature-tree", batched=True, tree=True, needs_head=True)(lambda ctx: _feature(ctx, tree=True))
register("feature-lookup", batched=True, needs_head=True)(lambda ctx: _feature_lookup(ctx))
register("lookup")(lambda ctx: LookupDrafter())
register("lookup-tree", batched=True, tree=True)(lambda ctx: _lookup_tree(ctx))
register("ngram")(lambda ctx: NgramDrafter(ctx.manifest.vocab_size, bundle_table(ctx), order=2))
register("unigram")(lambda ctx: NgramDrafter(ctx.manifest.vocab_size, bundle_table(ctx), order=1))


def check_drafter(spec) -> None:
    """Refuse an unknown drafter name, or an object without the ``Drafter`` interface, before any work."""
    if isinstance(spec, str):
        if spec not in DRAFTERS:
            raise ConfigError(f"drafter={spec!r}: expected one of {', '.join(DRAFTERS)}, or an object with the Drafter interface")
    elif not isinstance(spec, Drafter):
        raise ConfigError(
            f"drafter={type(spec).__name__!r} object lacks the Drafter interface (name, calls, start, propose, commit); "
            f"pass one of {', '.join(DRAFTERS)} or such an object"
        )


def _hierarchical(ctx: DrafterContext):
    from specdec.runtime.proposers import Hierarchical

    return Hierarchical(ctx.draft, ctx.manifest.gamma, ctx.manifest.vocab_size)


def _lookup_tree(ctx: DrafterContext):
    from specdec.runtime.proposers import LookupTree

    return LookupTree(ctx.manifest.graph("target", "tree")[1].tokens - 1)  # the root takes one node


def _feature(ctx: DrafterContext, tree: bool = False):
    from specdec.runtime.proposers import FeatureHead, FeatureTree

    if tree:
        return FeatureTree(ctx.head, ctx.target, ctx.manifest.graph("target", "tree")[1].tokens - 1, ctx.manifest.vocab_size,
                           ctx.manifest.head_first())  # the root takes one node  # fmt: skip
    return FeatureHead(ctx.head, ctx.target, ctx.manifest.draft_stop(), ctx.manifest.head_first())


def _feature_lookup(ctx: DrafterContext):
    from specdec.runtime.proposers import FeatureLookup

    return FeatureLookup(ctx.head, ctx.target, stop_below=ctx.manifest.draft_stop(), first=ctx.manifest.head_first())


def bundle_default(manifest) -> str:
    """The drafter a bundle decodes with when none is named (``manifest.default_drafter()``)."""
    name = manifest.default_drafter()[0]
    if name not in DRAFTERS:
        raise BundleError(f"the bundle's default drafter {name!r} is not one this specdec runs ({', '.join(DRAFTERS)}); "
                          "name one (--drafter) or upgrade specdec")  # fmt: skip
    return name


def models_for(spec) -> tuple[str, ...]:
    """The bundle models an engine with this drafter loads: the target, and the draft model or
    the feature head when the drafter needs one."""
    if not isinstance(spec, str):
        return ("target",)
    r = DRAFTERS[spec]
    return ("target", *(("draft",) if r.needs_draft_model else ()), *(("head",) if r.needs_head else ()))


def needs_tree(spec) -> bool:
    return isinstance(spec, str) and DRAFTERS[spec].tree


def needs_draft_model(spec) -> bool:
    return isinstance(spec, str) and DRAFTERS[spec].needs_draft_model


def make_drafter(spec, ctx: DrafterContext) -> Drafter:
    """A fresh per-sequence drafter with its own state (an object is copied)."""
    check_drafter(spec)
    if not isinstance(spec, str):
        return copy.copy(spec)
    return DRAFTERS[spec].factory(ctx)


def make_proposer(spec, bundle: Path, manifest, draft, slots: int, target=None, head=None):
    """The proposer of an engine with ``slots`` slots: a batched registration's own, else a
    fresh drafter per slot behind ``proposers.PerRow`` (``draft``, ``target``, ``head``: the
    models' Executors, or None)."""
    from specdec.runtime.proposers import PerRow, SlotModel

    check_drafter(spec)
    if isinstance(spec, str) and DRAFTERS[spec].batched:
        return DRAFTERS[spec].factory(DrafterContext(bundle, manifest, draft, target, head))
    return PerRow([make_drafter(spec, DrafterContext(bundle, manifest, draft and SlotModel(draft, s))) for s in range(slots)])

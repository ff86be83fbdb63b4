"""Drafters: what proposes the tokens the target verifies.

One small interface. Every drafter works on the decoder's token buffer ``seq`` [MAX], where
``seq[:L]`` is committed (prompt + output) and proposals are written at ``seq[L:L+k]``:

    start(seq, L)                 a new request; seq[:L] is the prompt
    propose(seq, L, g, cfg, rng, q) -> k
                                  write k <= g tokens at seq[L:L+k]; when sampling, q[i] is the
                                  distribution token L+i was drawn from (one-hot for the
                                  deterministic drafters, which Algorithm 1 handles exactly)
    commit(L, n)                  the target kept n of them (seq[:L+n+1] is now committed)

Speculative sampling is exact for any q that truly is the distribution each token was drawn
from, so every drafter here keeps the target's output distribution:

- ``ModelDrafter``: the bundle's draft model (sampled from its standardized rows).
- ``NgramDrafter``: a bigram ("ngram") or unigram ("unigram") table, the most frequent successor; table lookups,
  c ≈ 0 (paper §3.6, Table 3). The table comes from the bundle (``specdec-export
  --ngram-corpus``) or, without one, from each request's prompt.
- ``LookupDrafter``: prompt lookup, copying what followed the latest earlier occurrence of
  the last n tokens of prompt + output (§3.6, "copying from the prompt").
- ``ModelDrafter(inner=...)``: hierarchical. A cheap drafter proposes tokens *for the draft
  model*, which checks them with one call of its dynamic graph and speculative sampling
  against its own q. What it emits is then distributed exactly as the draft model's own
  samples, so the q rows handed to the target are the draft's and the target level stays exact.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Protocol

import numpy as np

from specdec.errors import BundleError, ConfigError
from specdec.runtime.sampling import SamplingConfig, sample, standardize
from specdec.runtime.speculative import verify, verify_greedy

DRAFTERS = ("model", "ngram", "unigram", "lookup", "hierarchical")


class Drafter(Protocol):
    name: str
    free: bool  # True when proposing costs ~nothing next to a target call (c ≈ 0)
    calls: int  # proposal calls so far (draft-model calls for the model drafters)

    def start(self, seq: np.ndarray, length: int) -> None: ...

    def propose(self, seq: np.ndarray, length: int, gamma: int, cfg: SamplingConfig, rng: np.random.Generator, q: np.ndarray) -> int: ...

    def commit(self, length: int, accepted: int) -> None:
        """seq[:length + accepted + 1] is now committed (the target's token included)."""
        ...


def one_hot(q: np.ndarray, tokens: np.ndarray) -> None:
    """q[i] = e_{tokens[i]}: the distribution of a deterministic proposal."""
    k = len(tokens)
    q[:k] = 0.0
    q[np.arange(k), tokens] = 1.0


class LookupDrafter:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n = max_ngram
    down to min_ngram) in seq[:L] and propose up to ``max_tokens`` tokens that followed it."""

    name = "lookup"
    free = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_tokens: int | None = None):
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise ConfigError(f"lookup n-gram sizes {min_ngram}..{max_ngram}: expected integers 1 <= min <= max")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ConfigError(f"lookup max_tokens={max_tokens!r}: expected an integer >= 1 or None (= gamma)")
        self.max_ngram, self.min_ngram, self.max_tokens = max_ngram, min_ngram, max_tokens
        self.calls = 0

    def start(self, seq: np.ndarray, length: int) -> None:
        pass

    def match(self, seq: np.ndarray, length: int) -> int:
        """Start of the continuation of the latest occurrence of the longest suffix (up to
        max_ngram tokens, at least min_ngram) in seq[:length-1], or -1."""
        ends = np.flatnonzero(seq[: length - 1] == seq[length - 1])  # candidates matching 1 token
        n = 1
        while n < self.max_ngram and ends.size:
            longer = ends[ends >= n]
            longer = longer[seq[longer - n] == seq[length - 1 - n]]
            if not longer.size:
                break
            ends, n = longer, n + 1
        return int(ends[-1]) + 1 if ends.size and n >= self.min_ngram else -1

    def propose(self, seq, length, gamma, cfg, rng, q) -> int:
        self.calls += 1
        src = self.match(seq, length)
        if src < 0:
            return 0
        k = min(gamma, length - src, self.max_tokens or gamma)
        seq[length : length + k] = seq[src : src + k]
        if not cfg.greedy:
            one_hot(q, seq[length : length + k])
        return k

    def commit(self, length: int, accepted: int) -> None:
        pass


class NgramTable:
    """Most frequent successor per token (-1: none seen), and the most frequent token."""

    def __init__(self, successor: np.ndarray, top: int):
        self.successor = successor  # [V] int64
        self.top = int(top)

    @classmethod
    def count(cls, ids: np.ndarray, vocab: int) -> NgramTable:
        """Bigram and unigram counts of a token stream; ties go to the lower token id."""
        ids = np.asarray(ids, dtype=np.int64)
        successor = np.full((vocab,), -1, dtype=np.int64)  # [V]
        top = int(np.bincount(ids, minlength=vocab).argmax()) if ids.size else 0
        if ids.size > 1:
            pairs, counts = np.unique(ids[:-1] * vocab + ids[1:], return_counts=True)  # sorted by (prev, next)
            prev, nxt = pairs // vocab, pairs % vocab
            order = np.lexsort((nxt, -counts, prev))  # per prev: highest count, then lowest next
            first = np.unique(prev[order], return_index=True)[1]
            successor[prev[order][first]] = nxt[order][first]
        return cls(successor, top)

    def save(self, path: Path) -> None:
        np.savez(path, successor=self.successor, top=np.int64(self.top))

    @classmethod
    def load(cls, path: Path, vocab: int) -> NgramTable:
        try:
            with np.load(path) as z:
                successor, top = z["successor"], int(z["top"])
        except (OSError, KeyError, ValueError) as e:
            raise BundleError(f"n-gram table {path} is unreadable ({e}); re-export with --ngram-corpus") from None
        if successor.shape != (vocab,) or not -1 <= successor.min() <= successor.max() < vocab:
            raise BundleError(f"n-gram table {path} has shape {successor.shape}, expected ({vocab},) token ids; re-export it")
        return cls(successor.astype(np.int64), top)


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

    free = True

    def __init__(self, vocab: int, table: NgramTable | None = None, order: int = 2):
        if order not in (1, 2):
            raise ConfigError(f"n-gram order {order!r}: expected 1 (unigram) or 2 (bigram)")
        self.vocab, self.fixed, self.order = vocab, table, order
        self.name = "ngram" if order == 2 else "unigram"
        self.table = table
        self.counts: BigramCounts | None = None
        self.seq: np.ndarray | None = None
        self.calls = 0

    def start(self, seq: np.ndarray, length: int) -> None:
        if self.fixed is None:
            self.counts = BigramCounts(self.vocab)
            self.counts.add(seq[:length].tolist())
            self.table, self.seq = self.counts.table, seq

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

    def commit(self, length: int, accepted: int) -> None:
        if self.counts is not None:
            self.counts.add(self.seq[length : length + accepted + 1].tolist(), int(self.seq[length - 1]))


class ModelDrafter:
    """The bundle's draft model over its own KV cache; with ``inner``, hierarchical.

    Cache invariant: rows for seq[:cache.length] are held; seq[cache.length:L] (1 token, or
    2 after a fully accepted call) are fed on the next call.
    """

    free = False

    def __init__(self, model, inner: Drafter | None = None, inner_gamma: int | None = None):
        self.model = model  # decoder.Model: cache, prefill (any length), decode (1 token)
        self.inner = inner
        self.inner_gamma = inner_gamma
        self.name = "model" if inner is None else f"hierarchical({inner.name})"
        self.calls = 0  # draft-model calls, for the stats
        self._r = None  # [γ, V] inner proposals' one-hot rows, allocated on first use

    def start(self, seq: np.ndarray, length: int) -> None:
        cache = self.model.cache
        cache.reset()
        if length > 1:
            self.model.prefill.run(seq[: length - 1])
            cache.append(length - 1)
        if self.inner is not None:
            self.inner.start(seq, length)

    def _run(self, feed: np.ndarray) -> np.ndarray:
        """Logits [len(feed), V] for the tokens fed, appended to the cache (caller rewinds)."""
        engine = self.model.decode if len(feed) == 1 else self.model.prefill
        rows = engine.run(feed)
        self.model.cache.append(len(feed))
        self.calls += 1
        return rows

    def propose(self, seq, length, gamma, cfg, rng, q) -> int:
        if self.inner is None:
            return self._propose_plain(seq, length, gamma, cfg, rng, q)
        return self._propose_hierarchical(seq, length, gamma, cfg, rng, q)

    def _propose_plain(self, seq, length, gamma, cfg, rng, q) -> int:
        cache = self.model.cache
        row = self._run(seq[cache.length : length])[-1]  # [V]
        for i in range(gamma):
            if cfg.greedy:
                seq[length + i] = row.argmax()
            else:
                q[i] = standardize(row, cfg)
                seq[length + i] = sample(q[i], rng)
            if i < gamma - 1:
                row = self._run(seq[length + i : length + i + 1])[0]
        return gamma

    def _propose_hierarchical(self, seq, length, gamma, cfg, rng, q) -> int:
        """Fill seq[length:length+gamma] with draft-model samples, each call checking the inner
        drafter's guesses: feed pending + guesses y_1..y_h, keep the accepted prefix and the
        draft's own next token (Algorithm 1 one level down)."""
        cache, inner = self.model.cache, self.inner
        if self._r is None:
            self._r = np.zeros_like(q)
        cur = length  # next position to fill
        while cur < length + gamma:
            room = length + gamma - cur
            h = inner.propose(seq, cur, min(room - 1, self.inner_gamma or room), cfg, rng, self._r) if room > 1 else 0
            rows = self._run(seq[cache.length : cur + h])[-(h + 1) :]  # [h+1, V]: the draft's rows at cur..cur+h
            if cfg.greedy:
                m, token = verify_greedy(seq[cur : cur + h], rows)
            else:
                p = standardize(rows, cfg)  # [h+1, V]
                m, token = verify(seq[cur : cur + h], self._r[:h], p, rng)
                q[cur - length : cur - length + m + 1] = p[: m + 1]  # m <= h <= room - 1: all fit
            seq[cur + m] = token
            inner.commit(cur, m)
            cache.rewind_to(cur + m)  # rows for the guesses kept; the draft's own token is not fed yet
            cur += m + 1
        return gamma

    def commit(self, length: int, accepted: int) -> None:
        cache = self.model.cache
        cache.rewind_to(min(cache.length, length + accepted))


MODEL_DRAFTERS = ("model", "hierarchical")


def check_drafter(spec) -> None:
    """Refuse an unknown drafter before any work."""
    if isinstance(spec, (LookupDrafter, NgramDrafter)):
        return
    if spec not in DRAFTERS:
        raise ConfigError(f"drafter={spec!r}: expected one of {', '.join(DRAFTERS)} (or a LookupDrafter / NgramDrafter)")


def bundle_table(bundle: Path, manifest) -> NgramTable | None:
    """The bundle's corpus n-gram table (``specdec-export --ngram-corpus``), if it has one."""
    if not manifest.ngram:
        return None
    from specdec.manifest import inside

    return NgramTable.load(inside(bundle, manifest.ngram["file"]), manifest.vocab_size)


def make_drafter(spec, draft_model, bundle: Path, manifest) -> Drafter:
    """A fresh drafter with its own state, for one decoder."""
    check_drafter(spec)
    if not isinstance(spec, str):
        return copy.copy(spec)
    if spec == "model":
        return ModelDrafter(draft_model)
    if spec == "hierarchical":
        return ModelDrafter(draft_model, inner=LookupDrafter())
    if spec == "lookup":
        return LookupDrafter()
    return NgramDrafter(manifest.vocab_size, bundle_table(bundle, manifest), order=1 if spec == "unigram" else 2)

"""Next-token log-probs of many sequences from one model, each fed only past the longest prefix a slot holds.

    PrefixScorer(executor)
      start(prompt, source)  every slot emptied (an encoder-decoder's source encoded into each),
                             the prompt fed once
      run(paths, spans)      -> per path, the log-softmax [span, V] of its last ``span`` prefixes

What beam search needs from a model: its beams are sequences that share long prefixes and
branch, and each step (or each speculative round) asks for the next-token distributions of a
few of them. Each slot of the executor's cache holds one sequence's KV rows (``tokens``);
``run`` gives each path the slot that holds most of it, copies the rows from another slot when
that one holds more (``Executor.copy``: siblings of one parent share its rows), rolls the slot
back to where it and the path differ (O(1)), and feeds the rest, all paths in one batched call
where the executor has batched graphs (else one call per path: a bundle without --max-batch);
an encoder-decoder's beams are rows too, each reading the source's K/V encoded once per search.
Copies never overwrite rows another copy still reads, and a slot whose rows cannot be copied (a
device cache) is fed instead, so the result never depends on which slot served a path.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from specdec.engines.executor import Executor
from specdec.errors import InputError
from specdec.runtime.sampling import log_softmax


class PrefixScorer:
    """One model (``executor``) scoring sequences over all of its slots."""

    def __init__(self, executor: Executor):
        self.model = executor
        self.slots = executor.slots
        self.max_seq = executor.cache.max_seq
        self.tokens = np.zeros((self.slots, self.max_seq), dtype=np.int64)  # [slots, MAX]: what each slot's KV rows hold
        runners = list(executor.batched.values())
        self.rows = max(executor.batched, default=1)  # paths per call (1: a bundle without batched graphs)
        self.chunk = min((r.max_tokens for r in runners), default=self.max_seq)  # tokens a row feeds in a call of several
        one = executor.dynamic is not None or not runners  # a batch-1 graph takes any length
        self.single = self.max_seq if one else max(runners[0].single, self.chunk)  # tokens one row feeds alone in a call
        self.prompt_len = 1
        self.fed = 0  # tokens fed (what the search cost), copied rows excluded
        self.copied = 0
        self.seconds = 0.0  # in run

    def start(self, prompt: np.ndarray, source: np.ndarray | None = None) -> None:
        """A new search: every slot emptied (an encoder-decoder's ``source`` encoded into each),
        and the prompt but its last token fed into slot 0, which the first paths then share.
        Every path ``run`` scores until the next ``start`` must begin with this prompt."""
        self.prompt_len = len(prompt)
        for s in range(self.slots):
            self.model.reset(s)
            if source is not None and s == 0:
                self.model.encode(s, source)
            elif source is not None:  # encoded once, copied to the other slots
                self.model.share_source(0, s)
        if len(prompt) > 1:
            self._feed_alone(0, prompt, 0, len(prompt) - 1)

    def _matches(self, path: np.ndarray, cap: int, lengths: np.ndarray) -> np.ndarray:
        """Rows of each slot that ``path`` can keep (at most ``cap``) [slots]. Every path extends
        the prompt and every slot holds a prefix of it, so the comparison starts past it."""
        keep = np.minimum(lengths, cap)  # [slots]
        lo, hi = self.prompt_len - 1, int(keep.max())
        if hi <= lo:
            return keep
        differ = self.tokens[:, lo:hi] != path[lo:hi]  # [slots, hi - lo]
        differ |= np.arange(lo, hi) >= keep[:, None]  # past a slot's rows
        first = np.where(differ.any(axis=1), differ.argmax(axis=1) + lo, hi)
        return np.minimum(first, keep)

    def run(self, paths: Sequence[np.ndarray], spans: Sequence[int]) -> list[np.ndarray]:
        """For path i (prompt + generated, distinct), the next-token log-softmax after each of its
        last ``spans[i]`` prefixes [spans[i], V]: row j follows path[: len - spans[i] + 1 + j]."""
        t0 = time.perf_counter()
        n = len(paths)
        if n > self.slots:
            raise InputError(f"{n} sequences to score at once; this scorer has {self.slots} slots")
        for p, sp in zip(paths, spans):
            if not 1 <= sp <= min(len(p) - self.prompt_len + 1, self.chunk) or len(p) > self.max_seq:
                raise InputError(f"a path of {len(p)} tokens scored at its last {sp}: expected 1..{min(len(p) - self.prompt_len + 1, self.chunk)} "
                                 f"positions past the prompt, within max-seq-len {self.max_seq}")  # fmt: skip
        lengths = np.array([self.model.length(s) for s in range(self.slots)])  # [slots]
        match = np.stack([self._matches(p, len(p) - sp, lengths) for p, sp in zip(paths, spans)])  # [n, slots]
        slot = self._assign(match)
        keep = self._copy(paths, match, slot)
        out: list[np.ndarray] = [np.empty(0)] * n
        for i, (s, p, sp) in enumerate(zip(slot, paths, spans)):
            self.model.rewind_to(s, keep[i])
            if len(p) - keep[i] > self.chunk:  # longer than a batched call takes: fed alone up to its scored positions
                self._feed_alone(s, p, keep[i], len(p) - sp)
                keep[i] = len(p) - sp
        order = sorted(range(n), key=lambda i: slot[i])  # a slot keeps its row of the call: fewer buffer rebinds
        for lo in range(0, n, self.rows):
            group = order[lo : lo + self.rows]
            feeds = [paths[i][keep[i] :] for i in group]
            logits = self.model.forward([slot[i] for i in group], feeds)  # [g, S, V]
            for j, i in enumerate(group):
                f = len(feeds[j])
                out[i] = log_softmax(logits[j, f - spans[i] : f], np.float32)  # [span, V], as HF's beam scores
                self._commit(slot[i], paths[i], keep[i], f)
        self.seconds += time.perf_counter() - t0
        return out

    def _assign(self, match: np.ndarray) -> list[int]:
        """A distinct slot per path: the best matches first."""
        n = match.shape[0]
        slot, taken = [-1] * n, set()
        for flat in np.argsort(-match, axis=None, kind="stable"):
            i, s = divmod(int(flat), self.slots)
            if slot[i] < 0 and s not in taken:
                slot[i] = s
                taken.add(s)
        return slot

    def _copy(self, paths: Sequence[np.ndarray], match: np.ndarray, slot: list[int]) -> list[int]:
        """Copy into each path's slot the rows another slot holds beyond its own (siblings of
        a parent); the rows each slot keeps. A copy runs only once no pending copy still reads
        its destination (the reads-from relation is acyclic: a path reads from a slot taken by
        a path matching it better)."""
        keep = [int(match[i, s]) for i, s in enumerate(slot)]
        pending = {}
        for i, s in enumerate(slot):
            src = int(np.argmax(match[i]))
            if match[i, src] > keep[i]:
                pending[i] = src
        while pending:
            ready = [i for i in pending if not any(src == slot[i] for j, src in pending.items() if j != i)]
            if not ready:
                break  # not expected; the rest are fed instead
            for i in ready:
                src, s, stop = pending.pop(i), slot[i], int(match[i].max())
                self.model.rewind_to(s, keep[i])
                if self.model.copy(src, s, stop):
                    self.tokens[s, keep[i] : stop] = self.tokens[src, keep[i] : stop]
                    self.copied += stop - keep[i]
                    keep[i] = stop
        return keep

    def _feed_alone(self, s: int, path: np.ndarray, start: int, stop: int) -> None:
        """Feed path[start:stop] into slot ``s`` in one-row calls (a prompt, a long branch)."""
        self.model.rewind_to(s, start)
        for lo in range(start, stop, self.single):
            hi = min(stop, lo + self.single)
            self.model.forward([s], [path[lo:hi]])
            self._commit(s, path, lo, hi - lo)

    def _commit(self, s: int, path: np.ndarray, start: int, n: int) -> None:
        self.model.commit(s, n)
        self.tokens[s, start : start + n] = path[start : start + n]
        self.fed += n

"""Beam search over a bundle: the target's own, or speculative (the paper's Appendix A.4); both the same search.

    BeamSearcher(bundle, manifest, sessions, provider, slots, rows)
      target, draft       a PrefixScorer each (runtime/prefixes.py) over its KV slots
      search(prompt, cfg, width, gamma, source)  -> (beams, BeamStats)

The search itself is ``BeamState`` (runtime/beam.py, Hugging Face's semantics); what differs
is where its rows come from.

Plain (``gamma=0``): each step, one batched target call over the distinct running beams.

Speculative (``gamma`` γ >= 1, ``width`` u >= 1), per round:
    1. the draft runs its own beam search of width u for γ steps from the running beams
       (scores start at theirs; EOS is never proposed: a finished beam never runs on);
    2. one target call feeds each leaf of the draft's beams (its u final beams, and any beam a
       later step dropped, or root none continued) from its root, so every beam the draft kept
       at every step is scored;
    3. the target's beam steps replay from the verified rows for as long as every running beam
       is among the scored prefixes (top_w(M_p) ⊆ the draft's candidates): from 1 up to γ + 1
       steps a round. A step only ever uses the target's own log-softmax, so the result is
       plain beam search's, token for token.
A round costs γ draft calls of up to u rows and a target call over up to w + uγ positions (A.4's
cost), in rows of up to γ + 1 tokens, against one target call of w rows of one token per plain step.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specdec.engines.executor import Executor, graph_names, open_sessions
from specdec.runtime.gamma import check as check_gamma
from specdec.engines.threads import ThreadPolicy
from specdec.errors import ConfigError
from specdec.manifest import Manifest
from specdec.runtime.beam import NEG, Beam, BeamConfig, BeamState, _best
from specdec.runtime.params import BeamParams
from specdec.runtime.prefixes import PrefixScorer
from specdec.runtime.request import Request
from specdec.runtime.text import TextCodec

clock = time.perf_counter


@dataclass
class BeamStats:
    steps: int = 0  # beam steps (tokens the longest beam got)
    rounds: int = 0  # target calls that advanced the search (plain: one per step)
    target_calls: int = 0  # forward calls after the prompt's
    draft_calls: int = 0
    target_tokens: int = 0  # positions the target computed after the prompt (each call's feeds)
    copied_rows: int = 0  # KV rows copied slot to slot (both models)
    target_seconds: float = 0.0  # in the target's calls (and their slot work), after the prompt
    draft_seconds: float = 0.0
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0
    steps_per_round: list[int] = field(default_factory=list)

    @property
    def mean_steps(self) -> float:
        """Beam steps a target call advanced (1 for plain search; up to γ + 1)."""
        return self.steps / max(self.rounds, 1)


@dataclass
class BeamOutput:
    tokens: list[int]  # generated (the prompt excluded), its last an EOS or stop token if one ended it
    score: float  # the sum of the target's log-probs / (len(tokens) ** length_penalty), as Hugging Face's sequences_scores
    text: str | None = None


@dataclass
class BeamResult:
    sequences: list[BeamOutput]  # num_return_sequences of them, best first
    stats: BeamStats

    @property
    def tokens(self) -> list[int]:
        return self.sequences[0].tokens

    @property
    def text(self) -> str | None:
        return self.sequences[0].text


class BeamSearcher:
    """A bundle's target (and draft) over ``slots`` cache slots each, for beam search."""

    def __init__(self, bundle: Path, manifest: Manifest, sessions: dict, provider: str, slots: tuple[int, int], rows: int,
                 draft_provider: str | None = None):  # fmt: skip
        """``slots``: the target's and the draft's (a round scores up to w + uγ target paths,
        the draft's steps up to max(w, u)); 0 draft slots: plain search only, no draft."""
        self.manifest, self.slots = manifest, slots
        self.target = PrefixScorer(Executor(bundle, manifest, "target", sessions, provider, slots[0], None, min(rows, slots[0])))
        self.draft = PrefixScorer(Executor(bundle, manifest, "draft", sessions, draft_provider or provider, slots[1], None, min(rows, slots[1]))) if slots[1] else None

    def search(self, prompt: np.ndarray, cfg: BeamConfig, width: int = 0, gamma: int = 0,
               source: np.ndarray | None = None) -> tuple[list[Beam], BeamStats]:  # fmt: skip
        """The best ``cfg.num_return_sequences`` beams of ``prompt`` (after the prompt: the
        generated tokens); ``gamma`` 0: plain, else speculative with draft width ``width``."""
        t0, stats = clock(), BeamStats()
        models = (self.target, self.draft) if gamma else (self.target,)
        for m in models:
            m.start(prompt, source)
        before = [(m.model.calls, m.fed, m.copied, m.seconds) for m in models]  # the search's own, the prompt excluded
        stats.prefill_seconds = clock() - t0
        state = BeamState(cfg)
        while not state.over:
            g = min(gamma, cfg.max_new_tokens - state.length - 1)  # the draft never passes the budget
            n = self._round(state, prompt, width, g) if g > 0 else self._plain(state, prompt)
            stats.rounds += 1
            stats.steps_per_round.append(n)
        stats.steps = state.length
        (tc, tf, tcp, ts), *rest = [(m.model.calls - c, m.fed - f, m.copied - cp, m.seconds - sec) for m, (c, f, cp, sec) in zip(models, before)]
        stats.target_calls, stats.target_tokens, stats.target_seconds = tc, tf, ts
        if rest:
            stats.draft_calls, _, dcp, stats.draft_seconds = rest[0]
            tcp += dcp
        stats.copied_rows = tcp
        stats.total_seconds = clock() - t0
        return state.result(), stats

    def _plain(self, state: BeamState, prompt: np.ndarray) -> int:
        """One step from the target's rows at the running beams."""
        roots = list(dict.fromkeys(state.running))  # distinct (the first step's w beams are one)
        rows = self.target.run([_seq(prompt, r) for r in roots], [1] * len(roots))
        known = {r: lp[0] for r, lp in zip(roots, rows)}
        state.step(np.stack([known[r] for r in state.running]))
        return 1

    def _round(self, state: BeamState, prompt: np.ndarray, width: int, gamma: int) -> int:
        """Draft γ steps of width u, verify them in one target call, replay the target's steps."""
        scores: dict[tuple[int, ...], np.float32] = {}
        for r, s in zip(state.running, state.run_scores):
            scores[r] = max(scores.get(r, NEG), s)
        roots = list(scores)
        beams, acc_scores = roots, np.array([scores[r] for r in roots], dtype=np.float32)
        eos = np.fromiter(state.eos, dtype=np.int64)
        leaves = []  # the draft's beams no later step continued (they are scored too), then its last step's
        for _ in range(gamma):
            lp = np.stack([x[0] for x in self.draft.run([_seq(prompt, b) for b in beams], [1] * len(beams))])  # [n, V]
            acc = lp + acc_scores[:, None]
            acc[:, eos] = NEG  # an EOS candidate finishes: it needs no continuation
            flat = acc.reshape(-1)
            top = _best(flat, width)
            vocab = lp.shape[-1]
            parents = set(int(i) // vocab for i in top)
            leaves += [b for i, b in enumerate(beams) if i not in parents]
            beams, acc_scores = [beams[i // vocab] + (int(i % vocab),) for i in top], flat[top]
        length = state.length
        paths = beams + leaves  # every prefix the draft kept, each on one path from its root
        spans = [len(p) - length + 1 for p in paths]
        rows = self.target.run([_seq(prompt, p) for p in paths], spans)
        known = {}
        for p, span, lp in zip(paths, spans, rows):
            for j in range(span):
                known[p[: len(p) - span + 1 + j]] = lp[j]
        steps = 0
        while not state.over and steps <= gamma:
            found = [known.get(r) for r in state.running]
            if any(x is None for x in found):
                break  # a beam the draft did not keep: the next round starts from here
            state.step(np.stack(found))
            steps += 1
        return steps


class BeamRunner:
    """Beam searches over a loaded bundle's sessions (``SpeculativeDecoder.beam_search``,
    ``BatchEngine.beam_search``), one at a time: its own lock and KV slots, allocated on the
    first search and grown when a wider one comes. Sessions it needs that the owner did not open
    (a batched engine with another drafter: the draft's graphs) are opened then and kept."""

    def __init__(self, bundle: Path, manifest: Manifest, sessions: dict, provider: str, threads: ThreadPolicy, codec: TextCodec | None,
                 draft_provider: str | None = None):  # fmt: skip
        self.bundle, self.manifest, self.sessions, self.provider, self.threads, self.codec = bundle, manifest, sessions, provider, threads, codec
        self.draft_provider = draft_provider  # the draft model's, where not the target's
        self.searcher: BeamSearcher | None = None
        self.lock = threading.Lock()

    def run(self, req: Request, params: BeamParams) -> BeamResult:
        """Search ``req``'s prompt (and source); its stop tokens finish beams. Blocks while
        another search runs."""
        m = self.manifest
        gamma = (m.gamma if m.draft is not None else 0) if params.gamma is None else check_gamma(params.gamma, m.gamma, auto=False)
        if gamma and m.draft is None:
            raise ConfigError(f"beam search at gamma={gamma} drafts with the draft model's beams, which this bundle lacks; pass gamma 0 (plain beam search)")
        w = params.num_beams
        width = w if params.draft_width is None else params.draft_width
        need = (w + width * gamma, w + width) if gamma else (w, 0)  # target paths a round scores; draft beams (none: plain)
        if m.max_batch > 1:  # at least 2 slots a model: its rows graph runs every call (the batch-1 graphs may not be open)
            need = tuple(max(2, n) if n else 0 for n in need)
        with self.lock:
            if self.searcher is None or any(a < b for a, b in zip(self.searcher.slots, need)):
                slots = tuple(max(a, b) for a, b in zip(need, self.searcher.slots if self.searcher else need))
                rows = min(m.max_batch, max(slots)) if m.max_batch > 1 else 1
                models = ("target", "draft") if slots[1] else ("target",)
                missing = [n for n in graph_names(m, models, rows, fused=False) if n not in self.sessions]
                self.sessions.update(open_sessions(self.bundle, m, missing, self.provider, self.threads, self.draft_provider))
                self.searcher = None  # the old slots go before the new ones are allocated
                self.searcher = BeamSearcher(self.bundle, m, self.sessions, self.provider, slots, rows, self.draft_provider)
            beams, stats = self.searcher.search(req.prompt, params.config(req.stop), width, gamma, req.source)
        decode = self.codec.decode if self.codec else (lambda ids: None)
        return BeamResult([BeamOutput(b.tokens, b.score, decode(b.tokens)) for b in beams], stats)


def _seq(prompt: np.ndarray, generated: tuple[int, ...]) -> np.ndarray:
    return np.concatenate([prompt, np.asarray(generated, dtype=np.int64)]) if generated else prompt

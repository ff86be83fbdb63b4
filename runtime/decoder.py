"""SpeculativeDecoder: a bundle's target and a drafter on ONNX Runtime, with exact speculative sampling.

One request (``generate`` / ``stream``) runs Algorithm 1 over buffers allocated at load:

    start:  the target takes prompt[:-1] (the last committed token is "pending"); the drafter starts
    repeat:
        draft:  the drafter writes x_1..x_k (k <= γ) after the committed tokens, recording the
                q_i each was drawn from (``drafters``); k = 0 means a plain target step
        verify: one target call on [last, x_1..x_k] gives p_1..p_{k+1} (the static K graph when
                k + 1 = K, else the dynamic-length graph: no padding); Algorithm 1
                (``speculative.verify``) keeps n drafts and draws the next token t
        commit: the target cache keeps n + 1 rows (``cache.append``); the drafter forgets the rest
        emit:   x_1..x_n, t, clipped to the budget and at a stop token (``clip``)

Invariant between iterations, with L committed tokens ``seq[:L]``: the target cache holds rows
for seq[:L-1] (seq[L-1] is fed by the next call). Rows written past a cache's length (rejected
drafts, padding) are never read: every call overwrites from the committed length.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from specdec.engines.ort import DEVICE, ModelRunners, model_runners, open_session, runtime_graphs
from specdec.engines.threads import ThreadPolicy
from specdec.errors import BusyError, InputError
from specdec.manifest import Manifest, load_manifest
from specdec.runtime.adaptive import AdaptiveGamma
from specdec.runtime.drafters import Drafter, DrafterContext, check_drafter, make_drafter, needs_draft_model
from specdec.runtime.request import Limits, Request, token_ids
from specdec.runtime.speculative import accept
from specdec.runtime.stats import Iteration, Stats
from specdec.runtime.text import Detokenizer, TextCodec

clock = time.perf_counter


class Piece(NamedTuple):
    """Tokens accepted by one iteration, and the text they complete (None without a tokenizer)."""

    tokens: list[int]
    text: str | None


class GenerationResult(NamedTuple):
    tokens: list[int]  # generated tokens only (an EOS that stopped decoding is included)
    text: str | None  # decoded text when the bundle has a tokenizer
    stats: Stats


def clip(tokens: np.ndarray, budget: int, stop: frozenset[int]) -> tuple[list[int], bool]:
    """What one iteration emits of its ``tokens``: at most ``budget``, ending at the first stop
    token (kept); and whether a stop token ended them."""
    out = tokens[:budget].tolist()
    for j, tok in enumerate(out):
        if tok in stop:
            return out[: j + 1], True
    return out, False


class SpeculativeDecoder:
    """Loads a bundle once; serves one request at a time (see ``fork`` for parallel requests).

    Thread safety: ONNX Runtime sessions are shared and thread-safe, but a decoder's caches and
    bindings are per decoder. Requests on one decoder from several threads are serialized by
    an internal lock; for parallel requests give each thread ``decoder.fork()``, which shares
    the sessions (weights are loaded once) and owns its buffers.

    Public state: ``sessions`` (graph name -> ONNX Runtime session, shared by forks),
    ``models`` ("target", and "draft" when the drafter needs it -> ``ModelRunners``),
    ``drafter``, and ``policies``: the adaptive-γ policies, one per (SamplingConfig, lenience),
    kept from request to request (a fork starts with none).
    """

    def __init__(self, bundle: Path, manifest: Manifest, sessions: dict, codec: TextCodec | None, provider: str,
                 drafter: str | Drafter = "model", threads: ThreadPolicy | None = None):  # fmt: skip
        self.bundle, self.manifest, self.codec, self.provider = bundle, manifest, codec, provider
        self.sessions, self.threads = sessions, threads or ThreadPolicy()
        self.limits = Limits.of(manifest)
        models = ("target", "draft") if needs_draft_model(drafter) else ("target",)  # no draft buffers for table/lookup drafters
        self.models = {m: model_runners(bundle, manifest, m, sessions, DEVICE[provider]) for m in models}
        self.drafter_spec = drafter
        self.drafter = make_drafter(drafter, DrafterContext(bundle, manifest, self.models.get("draft")))
        self.seq = np.zeros((manifest.max_seq_len,), dtype=np.int64)  # [MAX] committed + proposed tokens
        self.q = np.zeros((manifest.gamma, manifest.vocab_size), dtype=np.float64)  # [γ, V] draft rows as sampled
        self.policies: dict[tuple, AdaptiveGamma] = {}
        self._lock = threading.Lock()
        self._owner: int | None = None

    @classmethod
    def load(cls, bundle: str | Path, provider: str = "cpu", threads: ThreadPolicy | int | None = None,
             drafter: str | Drafter = "model") -> SpeculativeDecoder:  # fmt: skip
        """Check the bundle (manifest, paths, hashes, graph signatures) and load its graphs.

        Args:
            provider: "cpu" or "cuda".
            threads: a ``ThreadPolicy`` (``engines.threads``), or an int: the default policy
                (a pool per session) with that many threads; None: one per core.
            drafter: a registered name ("model", "ngram", "unigram", "lookup",
                "hierarchical") or an object with the ``Drafter`` interface.
        """
        bundle = Path(bundle)
        manifest = load_manifest(bundle)
        check_drafter(drafter)
        policy = ThreadPolicy.of(threads)
        sessions = {name: open_session(bundle, name, manifest.graphs[name], provider, policy) for name in runtime_graphs(manifest)}
        return cls(bundle, manifest, sessions, TextCodec.from_bundle(bundle, manifest), provider, drafter, policy)

    def fork(self, drafter: str | Drafter | None = None) -> SpeculativeDecoder:
        """Another decoder over the same sessions, with its own buffers: one per thread.
        ``drafter`` swaps the drafter (default: a fresh one of the same kind)."""
        if drafter is None:
            drafter = self.drafter_spec
        check_drafter(drafter)
        return SpeculativeDecoder(self.bundle, self.manifest, self.sessions, self.codec, self.provider, drafter, self.threads)

    # -- requests ---------------------------------------------------------------------------

    def request(
        self,
        prompt: str | Sequence[int] | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        gamma: int | str | None = None,
        ignore_eos: bool = False,
        lenience: float = 1.0,
        stop_token_ids: Sequence[int] = (),
        source: str | Sequence[int] | None = None,
    ) -> Request:
        """A checked ``Request`` (text is encoded with the bundle's tokenizer); raises a
        ``ValueError`` subclass naming the first bad argument. See ``Request`` for each one.

        Encoder-decoder bundles (``manifest.seq2seq``): the first argument is the source, or pass
        ``source=`` and then ``prompt`` is a decoder prefix after the decoder start token."""
        if self.manifest.seq2seq:
            prompt, source = self._seq2seq_inputs(prompt, source)
        elif isinstance(prompt, str):
            prompt = self._encode(prompt, "prompt")
        return Request(prompt, self.limits, max_new_tokens, temperature, top_k, top_p, seed, gamma, ignore_eos, lenience,
                       stop_token_ids, source)  # fmt: skip

    def _encode(self, text: str, what: str, special: bool = True) -> list[int]:
        if self.codec is None:
            raise InputError(f"{what} is text but bundle {self.bundle} has no tokenizer; pass token ids instead")
        return self.codec.encode(text, special)

    def _seq2seq_inputs(self, prompt, source) -> tuple[list[int], object]:
        """(decoder prompt, source ids) of an encoder-decoder request: the source encoded with the
        tokenizer's special tokens (T5's and BART's EOS), a decoder prefix without them."""
        if source is None:
            prompt, source = None, prompt
        if isinstance(source, str):
            source = self._encode(source, "source")
        if isinstance(prompt, str):
            prompt = self._encode(prompt, "prompt", special=False)
        start = [self.manifest.decoder_start_token_id]
        return start + ([] if prompt is None else token_ids(prompt, self.manifest.vocab_size).tolist()), source

    def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        gamma: int | str | None = None,
        ignore_eos: bool = False,
        lenience: float = 1.0,
        stop_token_ids: Sequence[int] = (),
        source: str | Sequence[int] | None = None,
    ) -> GenerationResult:
        """Decode a whole request; arguments as ``request`` (an encoder-decoder bundle's first
        argument is the source)."""
        req = self.request(prompt, max_new_tokens, temperature, top_k, top_p, seed, gamma, ignore_eos, lenience, stop_token_ids, source)
        stream = Stream(self, req, incremental_text=False)  # text decoded once, at the end
        for _ in stream:
            pass
        return stream.result

    def stream(
        self,
        prompt: str | Sequence[int] | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        gamma: int | str | None = None,
        ignore_eos: bool = False,
        lenience: float = 1.0,
        stop_token_ids: Sequence[int] = (),
        source: str | Sequence[int] | None = None,
    ) -> Stream:
        """An iterator of ``Piece`` as tokens are accepted; arguments as ``Request``.

        The request is checked here, before any work. The decoder is held from the first
        ``next`` until the stream is exhausted or closed.
        """
        req = self.request(prompt, max_new_tokens, temperature, top_k, top_p, seed, gamma, ignore_eos, lenience, stop_token_ids, source)
        return Stream(self, req)

    def run(self, req: Request, incremental_text: bool = True) -> Stream:
        """A ``Stream`` of an already built ``Request`` (e.g. one checked ahead of time)."""
        return Stream(self, req, incremental_text)

    # -- the loop ---------------------------------------------------------------------------

    def acquire(self) -> None:
        """Hold this decoder for one request (``Stream`` does this); a second request in the same
        thread raises ``BusyError``, one from another thread waits."""
        if self._owner == threading.get_ident():
            raise BusyError(
                "this decoder is already running a request in this thread (an unfinished stream); "
                "exhaust or close() it first, or use decoder.fork() for a second request"
            )
        self._lock.acquire()
        self._owner = threading.get_ident()

    def release(self) -> None:
        self._owner = None
        self._lock.release()

    def iterations(self, req: Request, stats: Stats) -> Iterator[list[int]]:
        """Yield the tokens each iteration emits, filling ``stats``. The caller holds the decoder
        (``acquire``); ``Stream`` is the public way to run a request."""
        target, drafter, seq, q, cfg = self.models["target"], self.drafter, self.seq, self.q, req.sampling
        rng = np.random.default_rng(req.seed)
        policy = self.policy(req)
        L = self._start(req, stats)  # committed tokens
        left = req.max_new_tokens
        while left > 0:
            g = min(policy.next() if policy else req.gamma, left - 1)  # never draft past the budget
            t0, calls = clock(), drafter.calls
            k = drafter.propose(seq, L, g, cfg, rng, q) if g else 0  # draft: x_1..x_k at seq[L:L+k]
            t1 = clock()
            logits = self._score(target, seq[L - 1 : L + k])  # [k + 1, V]: p_1..p_{k+1}
            t2 = clock()
            n, token = accept(seq[L : L + k], q[:k], logits, cfg, rng, req.lenience)
            target.cache.append(n + 1)  # commit: rows for seq[L-1] and x_1..x_n
            seq[L + n] = token
            drafter.commit(seq, L, n)
            it = Iteration(k, n, drafter.calls - calls, t1 - t0, t2 - t1, clock() - t2)
            stats.record(it)
            if policy:
                policy.update(it)
            emitted, stopped = clip(seq[L : L + n + 1], left, req.stop)
            L, left = L + n + 1, left - len(emitted)
            yield emitted
            if stopped:
                stats.finish_reason = "eos"
                return
        stats.finish_reason = "length"

    def policy(self, req: Request) -> AdaptiveGamma | None:
        """The adaptive-γ policy for ``req``'s sampling setting (made on first use), or None."""
        if not req.adaptive:
            return None
        key = (req.sampling, req.lenience)
        if key not in self.policies:
            self.policies[key] = AdaptiveGamma(req.gamma)
        return self.policies[key]

    def _start(self, req: Request, stats: Stats) -> int:
        """Empty caches; the encoders take the source (encoder-decoder bundles); the target takes
        prompt[:-1] and the drafter starts. Returns L = len(prompt)."""
        target, L, t0 = self.models["target"], len(req.prompt), clock()
        if req.source is not None:
            for model in self.models.values():  # the draft's own encoder too: its cost is prefill
                model.encode(req.source)
            source_aware = getattr(self.drafter, "use_source", None)
            if source_aware:
                source_aware(req.source)
        target.cache.reset()
        self.seq[:L] = req.prompt
        if L > 1:
            target.dynamic.run(self.seq[: L - 1])
            target.cache.append(L - 1)
        self.drafter.start(self.seq, L)
        stats.prefill_seconds += clock() - t0
        return L

    @staticmethod
    def _score(target: ModelRunners, tokens: np.ndarray) -> np.ndarray:
        """Target logits [k+1, V] for [last, x_1..x_k]: the static K graph when the call fills it,
        else the dynamic graph with exactly k + 1 tokens (padding costs real time on a CPU)."""
        runner = target.static if len(tokens) == target.static.capacity else target.dynamic
        return runner.run(tokens)


class Stream:
    """Iterator of ``Piece``; ``result`` holds tokens, text and stats so far (complete once exhausted).

    Dropping an unfinished stream frees its decoder at once (CPython closes the generator when
    the last reference goes), and ``close()`` does it explicitly.
    """

    def __init__(self, decoder: SpeculativeDecoder, req: Request, incremental_text: bool = True):
        self.decoder, self.request = decoder, req
        self.tokens: list[int] = []
        self.stats = Stats(
            gamma=req.gamma, prompt_tokens=len(req.prompt), drafter=decoder.drafter.name,
            adaptive=req.adaptive, lenience=req.lenience, threads=decoder.threads.label,
        )
        # The generator must not reference this object, or the two would form a cycle that
        # only the garbage collector frees, holding the decoder's lock until then.
        self._gen = _pieces(decoder, req, self.tokens, self.stats, incremental_text)

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Piece:
        return next(self._gen)

    def close(self) -> None:
        """Stop early and free the decoder for its next request."""
        self._gen.close()

    @property
    def result(self) -> GenerationResult:
        codec = self.decoder.codec
        return GenerationResult(list(self.tokens), codec.decode(self.tokens) if codec else None, self.stats)


def _pieces(dec: SpeculativeDecoder, req: Request, tokens: list[int], stats: Stats, text: bool = True) -> Iterator[Piece]:
    """Run ``req`` on ``dec`` under its lock, appending to ``tokens`` and filling ``stats``
    (with ``text``, each piece also carries its text delta)."""
    detok = Detokenizer(dec.codec) if dec.codec and text else None
    dec.acquire()
    start = clock()
    try:
        for toks in dec.iterations(req, stats):
            tokens += toks
            stats.new_tokens = len(tokens)
            stats.total_seconds = clock() - start
            yield Piece(toks, detok.push(toks) if detok else None)
        if detok:
            tail = detok.flush()
            if tail:
                yield Piece([], tail)
    finally:
        stats.total_seconds = clock() - start
        dec.release()

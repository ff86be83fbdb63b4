"""SpeculativeDecoder: a bundle's target and a drafter on ONNX Runtime, with exact speculative sampling.

One request (``generate`` / ``stream``) runs this loop over buffers allocated at load:

    prefill the target with prompt[:-1] (the last committed token is "pending"); start the drafter
    repeat:
        γ:      the request's, or chosen from this request's measured α and c (gamma="auto")
        draft:  the drafter writes x_1..x_k (k <= γ) after the committed tokens, recording the
                q_i each was drawn from (``drafters``: draft model, n-gram, prompt lookup,
                hierarchical); k = 0 means a plain target step
        target: one verify call on [last, x_1..x_k], giving p_1..p_{k+1} (the static K graph
                when k + 1 = K, else the dynamic-length graph: no padding)
        accept: n draft tokens and a next token t (Algorithm 1, ``speculative.verify``)
        commit: the target keeps n+1 rows; the drafter forgets what was rejected

Invariant between iterations, with L committed tokens ``seq[:L]``: the target cache holds rows
for seq[:L-1] (seq[L-1] is fed by the next call). Rows written past a cache's length (rejected
drafts, padding) are never read: every call overwrites from the committed length.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from specdec.engines.kv import KVCache
from specdec.engines.ort import DEVICE, OrtDecoder, decoder_for, open_session
from specdec.errors import BusyError, ConfigError, InputError
from specdec.manifest import Manifest, load_manifest
from specdec.runtime.adaptive import AdaptiveGamma
from specdec.runtime.drafters import MODEL_DRAFTERS, Drafter, check_drafter, make_drafter
from specdec.runtime.sampling import SamplingConfig, sample, standardize
from specdec.runtime.speculative import check_lenience, verify, verify_greedy
from specdec.runtime.stats import Stats
from specdec.runtime.text import Detokenizer, TextCodec

GRAPHS = {"target": ("target_prefill", "target_verify"), "draft": ("draft_prefill", "draft_step")}


class Model(NamedTuple):
    """One model's cache and its two engines over it: dynamic-length prefill and static decode."""

    cache: KVCache
    prefill: OrtDecoder  # any length: prompts, 1-token target steps, verify calls shorter than K
    decode: OrtDecoder  # target: K tokens (verify), draft: 1 token (step)


@dataclass(frozen=True)
class Request:
    """A checked request: everything ``_decode`` needs, validated before any work."""

    prompt: np.ndarray  # [P] int64
    max_new_tokens: int
    sampling: SamplingConfig
    gamma: int  # the most draft tokens per target call (adaptive: the ceiling)
    seed: int | None
    stop: frozenset[int]
    adaptive: bool = False  # choose each iteration's γ from this request's measured α and c
    lenience: float = 1.0  # 1 = exact; below 1 changes the output distribution (App. A.5)


class Piece(NamedTuple):
    """Tokens accepted by one iteration, and the text they complete (None without a tokenizer)."""

    tokens: list[int]
    text: str | None


class GenerationResult(NamedTuple):
    tokens: list[int]  # generated tokens only (an EOS that stopped decoding is included)
    text: str | None  # decoded text when the bundle has a tokenizer
    stats: Stats


class SpeculativeDecoder:
    """Loads a bundle once; serves one request at a time (see ``fork`` for parallel requests).

    Thread safety: ONNX Runtime sessions are shared and thread-safe, but a decoder's caches and
    bindings are per decoder. Requests on one decoder from several threads are serialized by
    an internal lock; for parallel requests give each thread ``decoder.fork()``, which shares
    the sessions (weights are loaded once) and owns its buffers.
    """

    def __init__(self, bundle: Path, manifest: Manifest, sessions: dict, codec: TextCodec | None, provider: str, drafter: str | Drafter = "model"):
        self.bundle, self.manifest, self.codec, self.provider = bundle, manifest, codec, provider
        self._sessions = sessions
        m = manifest
        kind = drafter if isinstance(drafter, str) else drafter.name
        self.models = {}
        for role, (prefill, decode) in GRAPHS.items():
            if role == "draft" and kind not in MODEL_DRAFTERS:
                continue  # no draft-model buffers for the table and lookup drafters
            spec = getattr(m, role)
            cache = KVCache(spec.num_layers, spec.num_kv_heads, m.max_seq_len, spec.head_dim, m.dtype, DEVICE[provider])
            engines = [decoder_for(bundle, g, m.graphs[g], cache, session=sessions[g]) for g in (prefill, decode)]
            self.models[role] = Model(cache, *engines)
        self.drafter_spec = drafter
        self.drafter = make_drafter(drafter, self.models.get("draft"), bundle, m)
        self.seq = np.zeros((m.max_seq_len,), dtype=np.int64)  # [MAX] committed + proposed tokens
        self.q = np.zeros((m.gamma, m.vocab_size), dtype=np.float64)  # [γ, V] draft rows as sampled
        self._policies: dict[tuple, AdaptiveGamma] = {}  # gamma="auto": one per (sampling, lenience), kept across requests
        self._lock = threading.Lock()
        self._owner: int | None = None

    @classmethod
    def load(cls, bundle: str | Path, provider: str = "cpu", threads: int | None = None, drafter: str | Drafter = "model") -> SpeculativeDecoder:
        """Check the bundle (manifest, paths, hashes, graph signatures) and load its graphs.

        ``drafter``: "model" (the bundle's draft model), "ngram" (bigram table), "lookup"
        (prompt lookup), "hierarchical" (the draft model, itself sped up by prompt lookup),
        or a ``LookupDrafter`` / ``NgramDrafter`` configured by hand.
        """
        bundle = Path(bundle)
        manifest = load_manifest(bundle)
        check_drafter(drafter)
        sessions = {
            g: open_session(bundle, g, manifest.graphs[g], provider, threads) for pair in GRAPHS.values() for g in pair
        }
        return cls(bundle, manifest, sessions, TextCodec.from_bundle(bundle, manifest), provider, drafter)

    def fork(self, drafter: str | Drafter | None = None) -> SpeculativeDecoder:
        """Another decoder over the same sessions, with its own buffers: one per thread.
        ``drafter`` swaps the drafter (default: a fresh one of the same kind)."""
        if drafter is None:
            drafter = self.drafter_spec
        check_drafter(drafter)
        return SpeculativeDecoder(self.bundle, self.manifest, self._sessions, self.codec, self.provider, drafter)

    # -- requests ---------------------------------------------------------------------------

    def request(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        gamma: int | str | None = None,
        ignore_eos: bool = False,
        lenience: float = 1.0,
    ) -> Request:
        """Check every argument; raises a ``ValueError`` subclass naming the bad one.

        ``gamma``: draft tokens per target call, 0..the bundle's γ (default: the bundle's), or
        "auto" to choose it each iteration from the measured α and c (§3.5) up to the bundle's γ.
        ``lenience``: 1 is exact; l < 1 accepts more drafts and changes the output distribution,
        with the guarantee that no token is sampled with probability above p(x) / l (App. A.5).
        """
        m = self.manifest
        sampling = SamplingConfig(temperature, top_k, top_p)
        lenience = check_lenience(lenience)
        adaptive = gamma == "auto"
        if gamma is None or adaptive:
            gamma = m.gamma
        if isinstance(gamma, bool) or not isinstance(gamma, (int, np.integer)) or not 0 <= gamma <= m.gamma:
            raise ConfigError(
                f"gamma={gamma!r}: this bundle's verify graph takes K={m.k} tokens, so gamma must be 0..{m.gamma} or 'auto'; "
                f"re-export with a larger --gamma for more"
            )
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens={max_new_tokens!r}: expected an integer >= 1")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
            raise InputError(f"seed={seed!r}: expected an integer >= 0 or None")
        ids = self._prompt_ids(prompt)
        need = len(ids) + max_new_tokens + m.gamma
        if need > m.max_seq_len:
            raise InputError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) + the bundle's gamma ({m.gamma}) = {need} "
                f"exceeds max-seq-len {m.max_seq_len}; shorten the request or re-export with a larger --max-seq-len"
            )
        stop = frozenset() if ignore_eos else frozenset(m.eos_token_ids)
        return Request(ids, int(max_new_tokens), sampling, int(gamma), seed, stop, adaptive, lenience)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> np.ndarray:
        if isinstance(prompt, str):
            if self.codec is None:
                raise InputError(f"prompt is text but bundle {self.bundle} has no tokenizer; pass token ids instead")
            ids = self.codec.encode(prompt)
        else:
            ids = prompt
        try:
            arr = np.asarray(ids)
        except (TypeError, ValueError):  # ragged nesting
            arr = np.asarray([[]])
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise InputError(f"prompt {str(prompt)[:60]!r}: expected a string or a flat list of integer token ids")
        if arr.size == 0:
            raise InputError("prompt is empty: it needs at least one token")
        vocab = self.manifest.vocab_size
        bad = arr[(arr < 0) | (arr >= vocab)]
        if bad.size:
            raise InputError(f"prompt token id {int(bad[0])} is outside the vocabulary [0, {vocab}); pass ids from the bundle's tokenizer")
        return arr.astype(np.int64)

    def generate(self, prompt: str | Sequence[int], **kwargs) -> GenerationResult:
        """Decode a whole request; arguments as ``request``."""
        stream = Stream(self, self.request(prompt, **kwargs), incremental_text=False)  # text decoded once, at the end
        for _ in stream:
            pass
        return stream.result

    def stream(self, prompt: str | Sequence[int], **kwargs) -> Stream:
        """An iterator of ``Piece`` as tokens are accepted; arguments as ``request``.

        The request is checked here, before any work. The decoder is held from the first
        ``next`` until the stream is exhausted or closed.
        """
        return Stream(self, self.request(prompt, **kwargs))

    # -- the loop ---------------------------------------------------------------------------

    def _acquire(self) -> None:
        if self._owner == threading.get_ident():
            raise BusyError(
                "this decoder is already running a request in this thread (an unfinished stream); "
                "exhaust or close() it first, or use decoder.fork() for a second request"
            )
        self._lock.acquire()
        self._owner = threading.get_ident()

    def _release(self) -> None:
        self._owner = None
        self._lock.release()

    def _decode(self, req: Request, stats: Stats) -> Iterator[list[int]]:
        """Yield the tokens each iteration emits; fills ``stats``. Caller holds the lock."""
        target, drafter = self.models["target"], self.drafter
        seq, q, cfg = self.seq, self.q, req.sampling
        rng = np.random.default_rng(req.seed)
        clock = time.perf_counter
        adaptive = None
        if req.adaptive:
            key = (cfg, req.lenience)
            adaptive = self._policies.get(key) or self._policies.setdefault(key, AdaptiveGamma(req.gamma))

        target.cache.reset()
        L = len(req.prompt)  # committed tokens
        seq[:L] = req.prompt
        t0 = clock()
        if L > 1:
            target.prefill.run(seq[: L - 1])
            target.cache.append(L - 1)
        drafter.start(seq, L)
        stats.prefill_seconds += clock() - t0
        produced = 0
        while produced < req.max_new_tokens:
            want = adaptive.next() if adaptive else req.gamma
            g = min(want, req.max_new_tokens - produced - 1)  # never draft past the budget
            t0 = clock()
            calls = drafter.calls
            k = drafter.propose(seq, L, g, cfg, rng, q) if g else 0  # proposals at seq[L:L+k]
            t1 = clock()
            if k == 0:  # plain autoregressive step through the target
                logits = target.prefill.run(seq[L - 1 : L])  # [1, V]
                target.cache.append(1)
                t2 = clock()
                n, token = 0, self._pick(logits[0], cfg, rng)
            else:
                # The static verify graph when the call fills it; else the dynamic graph, which
                # takes exactly k + 1 tokens (padding a static call costs real time on a CPU).
                verifier = target.decode if k + 1 == target.decode.capacity else target.prefill
                logits = verifier.run(seq[L - 1 : L + k])  # [k + 1, V]
                t2 = clock()
                if cfg.greedy:
                    n, token = verify_greedy(seq[L : L + k], logits, req.lenience)
                else:
                    n, token = verify(seq[L : L + k], q[:k], standardize(logits, cfg), rng, req.lenience)
                target.cache.append(n + 1)
                stats.verify_calls += 1
                stats.drafted += k
                stats.accepted += n
                stats.rejected += n < k
                for i in range(k):
                    stats.drafted_at[i] += 1
                    stats.accepted_at[i] += i < n
            seq[L + n] = token
            drafter.commit(L, n)  # seq[:L+n+1] is committed
            t3 = clock()
            if adaptive:
                adaptive.update(k, n, drafter.calls - calls, t1 - t0, t2 - t1)
            stats.draft_seconds += t1 - t0
            stats.target_seconds += t2 - t1
            stats.accept_seconds += t3 - t2
            stats.draft_calls += drafter.calls - calls
            stats.target_calls += 1
            emitted = seq[L : L + n + 1].tolist()
            L += n + 1
            emitted = emitted[: req.max_new_tokens - produced]
            for j, tok in enumerate(emitted):
                if tok in req.stop:
                    emitted = emitted[: j + 1]
                    stats.finish_reason = "eos"
                    break
            produced += len(emitted)
            yield emitted
            if stats.finish_reason == "eos":
                return
        stats.finish_reason = "length"

    @staticmethod
    def _pick(row: np.ndarray, cfg: SamplingConfig, rng: np.random.Generator) -> int:
        """The target's own next token from its logits row [V]."""
        return int(row.argmax()) if cfg.greedy else int(sample(standardize(row, cfg), rng))


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
            adaptive=req.adaptive, lenience=req.lenience,
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
    dec._acquire()
    start = time.perf_counter()
    try:
        for toks in dec._decode(req, stats):
            tokens += toks
            stats.new_tokens = len(tokens)
            stats.total_seconds = time.perf_counter() - start
            yield Piece(toks, detok.push(toks) if detok else None)
        if detok:
            tail = detok.flush()
            if tail:
                yield Piece([], tail)
    finally:
        stats.total_seconds = time.perf_counter() - start
        dec._release()

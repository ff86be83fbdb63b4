"""SpeculativeDecoder: one request at a time, the engine core with one slot stepped on the caller's thread.

    generate / stream / request  ->  a checked Request (runtime/request.py)
    Stream: the request's Handle; each ``next`` steps the engine (runtime/engine.py) until a
            piece is ready: prefill (the whole prompt at once), then per step propose ->
            one target call -> Algorithm 1 -> commit -> emit

Everything a step does is the batched engine's own code (``BatchEngine`` steps the same
``Engine`` from its thread): the two drivers differ only in who calls ``step``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

from specdec.engines.threads import ThreadPolicy
from specdec.errors import BusyError, InputError
from specdec.runtime.adaptive import AdaptiveGamma
from specdec.runtime.drafters import Drafter
from specdec.runtime.engine import Engine, clip
from specdec.runtime.handles import GenerationResult, Handle, Piece
from specdec.runtime.beam_search import BeamResult, BeamRunner
from specdec.runtime.params import BeamParams, SamplingParams
from specdec.runtime.loader import Loaded
from specdec.runtime.request import Request

if TYPE_CHECKING:
    from specdec.runtime.session import Session

__all__ = ["GenerationResult", "Piece", "SpeculativeDecoder", "Stream", "clip"]
clock = time.perf_counter


class SpeculativeDecoder:
    """Loads a bundle once; serves one request at a time (see ``fork`` for parallel requests).

    Thread safety: ONNX Runtime sessions are shared and thread-safe, but a decoder's caches and
    bindings are per decoder. Requests on one decoder from several threads are serialized by
    an internal lock; for parallel requests give each thread ``decoder.fork()``, which shares
    the sessions (weights are loaded once) and owns its buffers.

    Public state: ``sessions`` (graph name -> ONNX Runtime session, shared by forks),
    ``engine`` (the one-slot ``Engine``: ``engine.target`` / ``engine.draft`` are the models'
    executors), ``drafter``, and ``policies``: the adaptive-γ policies, one per sampling
    setting, kept from request to request (a fork starts with none).
    """

    def __init__(self, loaded: Loaded, drafter: str | Drafter = "model"):
        self.loaded = loaded
        self.bundle, self.manifest, self.codec, self.provider = loaded.bundle, loaded.manifest, loaded.codec, loaded.provider
        self.threads = loaded.threads
        self.limits = loaded.limits(drafter)
        self.drafter_spec = drafter
        self.engine = Engine(loaded.bundle, loaded.manifest, loaded.sessions, drafter, slots=1, provider=loaded.provider,
                             draft_provider=loaded.draft_provider)  # fmt: skip
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._beams: BeamRunner | None = None  # made on the first beam search

    @property
    def sessions(self) -> dict:
        """Graph name -> ONNX Runtime session, shared by this decoder's forks."""
        return self.loaded.sessions

    @classmethod
    def load(cls, bundle: str | Path, provider: str = "cpu", threads: ThreadPolicy | int | None = None,
             drafter: str | Drafter | None = None, verify: str = "full", draft_provider: str | None = None) -> SpeculativeDecoder:  # fmt: skip
        """Check the bundle (manifest, paths, hashes, graph signatures) and load the graphs its
        drafter needs (``runtime/loader.py``).

        Args:
            bundle: the folder specdec-export wrote, or a stored bundle's URI (s3://, https://,
                ...; ``specdec push``): fetched once into this machine's verified cache.
            provider: "cpu", "cuda", or "cuda-graph" (CUDA, its fixed-length calls replayed as captured CUDA graphs).
            threads: a ``ThreadPolicy`` (``engines.threads``), or an int: the default policy
                (a pool per session) with that many threads; None: one per core.
            drafter: a registered name (``runtime.drafters.DRAFTERS``: "model", "feature",
                "lookup", ...) or an object with the ``Drafter`` interface; None: the bundle's
                default (``manifest.default_drafter()``: the draft model unless export chose
                another), whose γ is then a request's default.
            verify: "full" checks every file's digest (skipped for files this user verified
                before and has not changed since); "size" checks sizes only, for a bundle you
                trust: changed bytes then load and run as another model (``load_manifest``).
            draft_provider: where the draft model or the feature head runs, when not on ``provider``:
                e.g. the target on "cuda-graph", the drafter on "cpu" (None: on ``provider``).
        """
        loaded, drafter = Loaded.open(bundle, drafter, 1, provider, threads, verify, draft_provider=draft_provider)
        return cls(loaded, drafter)

    def fork(self, drafter: str | Drafter | None = None) -> SpeculativeDecoder:
        """Another decoder over the same sessions, with its own buffers: one per thread.
        ``drafter`` swaps the drafter (default: a fresh one of the same kind); the graphs it
        needs that are not open yet (the draft model, the tree graph, the feature head) are
        opened on first use and shared from then on."""
        drafter = self.drafter_spec if drafter is None else drafter
        self.loaded.need(drafter)
        return SpeculativeDecoder(self.loaded, drafter)

    @property
    def drafter(self):
        """The proposer; for a per-sequence drafter, that drafter itself."""
        p = self.engine.proposer
        return p.drafters[0] if hasattr(p, "drafters") else p

    @property
    def policies(self) -> dict[tuple, AdaptiveGamma]:
        return self.engine.policies

    # -- requests ---------------------------------------------------------------------------

    def request(self, prompt: str | Sequence[int] | None = None, params: SamplingParams | None = None, *,
                source: str | Sequence[int] | None = None, **fields) -> Request:  # fmt: skip
        """A checked ``Request``; raises a ``ValueError`` subclass naming the first bad argument.

        ``params``: a ``SamplingParams``, or its fields by keyword (``max_new_tokens=``,
        ``temperature=``, ``top_k=``, ``top_p=``, ``seed=``, ``gamma=``, ``ignore_eos=``,
        ``lenience=``, ``stop_token_ids=``). Text is encoded with the bundle's tokenizer.
        Encoder-decoder bundles (``manifest.seq2seq``): the first argument is the source, or pass
        ``source=`` and then ``prompt`` is a decoder prefix after the decoder start token."""
        params = params if params is not None else SamplingParams.of(**fields)
        return self.loaded.request(prompt, params, self.limits, source)

    def generate(self, prompt: str | Sequence[int] | None = None, params: SamplingParams | None = None, *,
                 source: str | Sequence[int] | None = None, **fields) -> GenerationResult | BeamResult:  # fmt: skip
        """Decode a whole request; arguments as ``request``.

        With ``num_beams=w`` (Hugging Face's ``generate(num_beams=w)``) it is a beam search:
        ``fields`` are then ``BeamParams``' (``length_penalty``, ``early_stopping``,
        ``num_return_sequences``, ``gamma``, ...; ``do_sample=False`` is accepted) and the
        result is the ``BeamResult`` of ``beam_search``: ``.tokens`` and ``.text`` are the best
        sequence's, ``.sequences`` all those returned, best first."""
        if "num_beams" in fields:
            if params is not None:
                raise InputError(f"num_beams={fields['num_beams']!r} with a SamplingParams: pass the beam search's fields by "
                                 "keyword, or a BeamParams to beam_search()")
            return self.beam_search(prompt, BeamParams.from_generate(fields), source=source)
        stream = Stream(self, self.request(prompt, params, source=source, **fields), incremental_text=False)
        for _ in stream:
            pass
        return stream.result

    def stream(self, prompt: str | Sequence[int] | None = None, params: SamplingParams | None = None, *,
               source: str | Sequence[int] | None = None, **fields) -> Stream:  # fmt: skip
        """An iterator of ``Piece`` as tokens are accepted; arguments as ``request``.

        The request is checked here, before any work. The decoder is held from the first
        ``next`` until the stream is exhausted or closed.
        """
        return Stream(self, self.request(prompt, params, source=source, **fields))

    def beam_search(self, prompt: str | Sequence[int] | None = None, params: BeamParams | None = None, *,
                    source: str | Sequence[int] | None = None, **fields) -> BeamResult:  # fmt: skip
        """Beam search with Hugging Face's semantics (``generate(num_beams=w, do_sample=False)``),
        run on the batched graphs with beams as rows; with ``gamma`` > 0 the draft's beam search
        proposes and one target call verifies up to γ + 1 steps (App. A.4; runtime/beam_search.py).
        ``params``: a ``BeamParams`` or its fields by keyword (``num_beams=``, ``max_new_tokens=``,
        ``length_penalty=``, ``early_stopping=``, ``num_return_sequences=``, ``ignore_eos=``,
        ``stop_token_ids=``, ``gamma=``, ``draft_width=``). Inputs as ``request``."""
        params = params if params is not None else BeamParams.of(**fields)
        req = self.request(prompt, params.request_params, source=source)
        if self._beams is None:
            self._beams = BeamRunner(self.bundle, self.manifest, self.sessions, self.provider, self.threads, self.codec, self.loaded.draft_provider)
        self.acquire()
        try:
            return self._beams.run(req, params)
        finally:
            self.release()

    def run(self, req: Request, incremental_text: bool = True, reuse: bool = False) -> Stream:
        """A ``Stream`` of an already built ``Request`` (e.g. one checked ahead of time).
        ``reuse``: keep the prefix of its prompt that the cache holds from the last request
        (what a ``Session`` does)."""
        return Stream(self, req, incremental_text, reuse)

    def session(self, tokens: str | Sequence[int] = ()) -> Session:
        """A live sequence that grows turn by turn without re-reading its history
        (``runtime/session.py``): ``append``, ``generate``, ``stream``, ``rewind_to``, ``tokens``."""
        from specdec.runtime.session import Session

        return Session(self, tokens)

    # -- holding the decoder ----------------------------------------------------------------

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


class Stream:
    """Iterator of ``Piece`` for a request on a ``SpeculativeDecoder``: iterating its ``Handle``
    (``handle``) steps the engine on this thread. ``result`` holds tokens, text and stats so far
    (complete once exhausted).

    Dropping an unfinished stream frees its decoder at once (CPython closes the generator when
    the last reference goes), and ``close()`` does it explicitly.
    """

    def __init__(self, decoder: SpeculativeDecoder, req: Request, incremental_text: bool = True, reuse: bool = False):
        stats = decoder.loaded.stats(req, decoder.engine.proposer.name)
        self.decoder, self.request, self.stats = decoder, req, stats
        self.handle = Handle(req, decoder.codec if incremental_text else None, stats, pump=decoder.engine.step)
        # The generator must not reference this object, or the two would form a cycle that
        # only the garbage collector frees, holding the decoder's lock until then.
        self._gen = _pieces(decoder, self.handle, reuse)

    @property
    def tokens(self) -> list[int]:
        return self.handle.tokens

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
        h = self.handle
        return GenerationResult(list(self.tokens), codec.decode(self.tokens) if codec else None, self.stats, h.logprobs, h.prompt_logprobs)


def _pieces(dec: SpeculativeDecoder, handle: Handle, reuse: bool = False) -> Iterator[Piece]:
    """Run ``handle``'s request in slot 0 of ``dec``'s engine under its lock, yielding its pieces."""
    engine = dec.engine
    dec.acquire()
    start = clock()
    try:
        engine.start(handle.request, handle, 0, reuse)
        yield from handle
    finally:
        handle.stats.total_seconds = clock() - start
        engine.leave(0)  # an early close, or a failed call
        dec.release()

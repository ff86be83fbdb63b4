"""Opening a bundle for decoding, written once: ``SpeculativeDecoder``, ``BatchEngine``, sessions,
the server, ``specdec check`` and bench all load through ``Loaded.open``.

    Loaded.open(bundle, drafter, rows)   the manifest (checked), the drafter decided (the
                                         bundle's default when none is named), and a session
                                         for each graph that drafter needs at that many rows:
                                         the target, and the draft model or the feature head or
                                         the tree graph only when the drafter uses them
    loaded.need(drafter, rows)           open what another drafter needs (a fork, a bench
                                         sweep): sessions are shared and only grow
    loaded.request(prompt, params, ...)  a checked Request against the bundle
    loaded.stats(req, drafter_name)      a request's empty Stats
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdec.engines.executor import FUSED_PROVIDERS, graph_names, open_sessions
from specdec.engines.threads import ThreadPolicy
from specdec.manifest import Manifest, load_manifest
from specdec.runtime.drafters import bundle_default, check_drafter, models_for, needs_tree
from specdec.runtime.request import Limits, Request, make_request
from specdec.runtime.stats import Stats
from specdec.runtime.text import TextCodec
from specdec.store import local


@dataclass
class Loaded:
    """A bundle open for decoding: what every driver shares (``sessions`` grow, never shrink)."""

    bundle: Path
    manifest: Manifest
    sessions: dict  # graph name -> ONNX Runtime session
    codec: TextCodec | None
    provider: str
    threads: ThreadPolicy
    draft_provider: str | None = None  # the draft model's and the feature head's, where not the target's (None: the same)

    @classmethod
    def open(cls, bundle: str | Path, drafter=None, rows: int = 1, provider: str = "cpu", threads: ThreadPolicy | int | None = None,
             verify: str = "full", manifest: Manifest | None = None, draft_provider: str | None = None) -> tuple[Loaded, object]:  # fmt: skip
        """The bundle (a folder, or a stored bundle's URI: this machine's verified copy) with the
        sessions ``drafter`` needs for engines of ``rows`` rows, and the drafter decided (None:
        the bundle's default). ``manifest``: the bundle's, when the caller has loaded it already.
        ``draft_provider``: where the draft model and the feature head run, when not on ``provider``
        (the target on a GPU, the drafter on the CPU: ``docs/gpu.md``)."""
        bundle = local(bundle)
        manifest = manifest or load_manifest(bundle, verify)
        drafter = bundle_default(manifest) if drafter is None else drafter
        check_drafter(drafter)
        loaded = cls(bundle, manifest, {}, TextCodec.from_bundle(bundle, manifest), provider, ThreadPolicy.of(threads), draft_provider)
        loaded.need(drafter, rows)
        return loaded, drafter

    def need(self, drafter, rows: int = 1) -> None:
        """Open the sessions ``drafter`` needs at ``rows`` rows that are not open yet."""
        check_drafter(drafter)
        fused = (self.draft_provider or self.provider) in FUSED_PROVIDERS
        names = graph_names(self.manifest, models_for(drafter), rows, fused=fused, tree=needs_tree(drafter))
        missing = [n for n in names if n not in self.sessions]
        if missing:
            self.sessions.update(open_sessions(self.bundle, self.manifest, missing, self.provider, self.threads, self.draft_provider))

    def limits(self, drafter) -> Limits:
        return Limits.of(self.manifest, drafter)

    def request(self, prompt, params, limits: Limits, source=None) -> Request:
        """A checked ``Request`` (``make_request``; an encoder-decoder's decoder start token is the bundle's)."""
        m = self.manifest
        return make_request(prompt, params, limits, self.codec, source, m.decoder_start_token_id if m.seq2seq else None)

    def stats(self, req: Request, drafter: str) -> Stats:
        """A request's empty ``Stats``, named for ``drafter`` (the proposer's name)."""
        return Stats(gamma=req.gamma, prompt_tokens=len(req.prompt), drafter=drafter, adaptive=req.adaptive,
                     lenience=req.lenience, threads=self.threads.label)  # fmt: skip

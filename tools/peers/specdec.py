"""specdec's own runtime, in the same interleaved run as the peers it is compared with.

Imported as ``peers.specdec``; ``from specdec...`` below is the library (absolute imports).
"""

from __future__ import annotations

from pathlib import Path

from peers.base import ModeUnavailable, Peer, Sample


class SpecdecPeer(Peer):
    """specdec's own runtime on a bundle exported from the same pair, in the same interleaved run:
    autoregressive (γ = 0), the draft model at γ = K, adaptive γ, prompt lookup, n-gram table,
    hierarchical (draft model + prompt lookup). K = ``--draft-tokens`` or the bundle's γ."""

    name = "specdec"
    modes = ("autoregressive", "draft-model", "draft-model-adaptive", "prompt-lookup", "ngram", "hierarchical")
    DRAFTER = {"draft-model": "model", "draft-model-adaptive": "model", "prompt-lookup": "lookup",
               "ngram": "ngram", "hierarchical": "hierarchical"}

    def __init__(self, bundle: Path, threads: int, draft_tokens: int | None) -> None:
        from specdec.runtime import SpeculativeDecoder

        # The library's default thread policy (a pool per session), as the specdec CLI uses: no
        # process-wide ORT state, so the other peers' sessions are unaffected.
        base = SpeculativeDecoder.load(bundle, threads=threads)
        self.decoders = {d: base.fork(drafter=d) for d in set(self.DRAFTER.values())}
        self.decoders["model"] = base
        self.k = draft_tokens or base.manifest.gamma
        if self.k > base.manifest.gamma:
            raise ModeUnavailable(f"--draft-tokens {self.k} exceeds the bundle's gamma {base.manifest.gamma}")
        self.settings = {"bundle": str(bundle), "gamma": self.k, "ort_intra_op_threads": threads}

    @classmethod
    def from_args(cls, args) -> SpecdecPeer:
        return cls(args.bundle, args.threads, args.draft_tokens)

    def decode(self, mode: str, temperature: float, prompt: list[int], tokens: int, seed: int) -> Sample:
        gamma = 0 if mode == "autoregressive" else "auto" if mode.endswith("adaptive") else self.k
        dec = self.decoders[self.DRAFTER.get(mode, "model")]
        res = dec.generate(prompt, max_new_tokens=tokens, gamma=gamma, temperature=temperature, seed=seed, ignore_eos=True)
        s = res.stats
        stats = {"target_passes": s.target_calls + 1}
        if gamma != 0:
            stats.update(draft_tokens_accepted=s.accepted, draft_tokens_evaluated=s.drafted)
        return Sample(s.total_seconds - s.prefill_seconds, s.new_tokens, s.new_tokens, stats, res.tokens)

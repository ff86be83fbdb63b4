"""The peers that run in this python: transformers and specdec itself."""

from __future__ import annotations

import json

from specdec.commands.bench.peers.base import ModeUnavailable, Options, Peer, Sample
from specdec.commands.bench.peers.workers.timed_generate import timed_generate


def hf_generate(model, prompt: list[int], tokens: int, temperature: float, seed: int, pad: int | None, stats=dict, **kwargs) -> Sample:
    """``timed_generate`` as a Sample, with ``stats()`` read after it."""
    seconds, decoded, new = timed_generate(model, prompt, tokens, temperature, seed, pad, **kwargs)
    return Sample(seconds, decoded, len(new), stats(), new)


def pad_id(model_dir) -> int | None:
    """The pad token id, else the (first) EOS id: batch 1 never pads, but ``generate`` wants one."""
    cfg = json.loads((model_dir / "config.json").read_text())
    pad = cfg.get("eos_token_id") if cfg.get("pad_token_id") is None else cfg["pad_token_id"]
    return pad[0] if isinstance(pad, list) else pad


class HFPeer(Peer):
    name = "hf"
    modes = ("autoregressive", "assisted")
    draft_modes = ("assisted",)

    def __init__(self, o: Options) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(o.threads)
        self.target = AutoModelForCausalLM.from_pretrained(o.target, dtype=torch.float32).eval()  # fp32, as the ORT peers
        self.pad, self.passes = pad_id(o.target), 0
        self.target.register_forward_hook(lambda *_: setattr(self, "passes", self.passes + 1))
        self.settings, self.draft = {"torch_threads": o.threads}, None
        if o.draft is not None:
            self.draft = AutoModelForCausalLM.from_pretrained(o.draft, dtype=torch.float32).eval()
            gc, keys = self.draft.generation_config, ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
            if o.draft_tokens is not None:
                gc.update(**dict(zip(keys, (o.draft_tokens, "constant", 0.0))))
            self.assistant = {k: getattr(gc, k) for k in keys}
            self.settings.update(self.assistant)

    def decode(self, mode: str, temperature: float, prompt: list[int], tokens: int, seed: int) -> Sample:
        self.passes, kwargs = 0, {}
        if mode == "assisted" and self.draft is None:
            raise ModeUnavailable("no --draft given")
        if mode == "assisted":  # transformers adapts these across calls: reset them so order does not matter
            self.draft.generation_config.update(**self.assistant)
            kwargs["assistant_model"] = self.draft
        stats = (lambda: {"target_passes": float(self.passes)}) if mode == "assisted" else dict
        return hf_generate(self.target, prompt, tokens, temperature, seed, self.pad, stats, **kwargs)


class SpecdecPeer(Peer):
    """specdec's runtime on the bundle (the library's default thread policy: a pool per session,
    no process-wide ORT state). ``default``: the bundle's default drafter at its default γ, what
    ``SpeculativeDecoder.load(bundle)`` decodes with; the other speculative modes name their
    drafter, at K = ``--draft-tokens`` or the bundle's γ."""

    name = "specdec"
    modes = ("autoregressive", "default", "draft-model", "draft-model-adaptive", "prompt-lookup", "ngram", "hierarchical")
    DRAFTER = {"draft-model": "model", "draft-model-adaptive": "model", "prompt-lookup": "lookup", "ngram": "ngram", "hierarchical": "hierarchical"}

    def __init__(self, o: Options) -> None:
        from specdec.runtime import SpeculativeDecoder

        base = SpeculativeDecoder.load(o.bundle, threads=o.threads)  # the bundle's default drafter
        self.k = o.draft_tokens or base.manifest.gamma
        if self.k > base.manifest.gamma:
            raise ModeUnavailable(f"--draft-tokens {self.k} exceeds the bundle's gamma {base.manifest.gamma}")
        name, gamma = base.manifest.default_drafter()
        self.default_gamma = o.draft_tokens or gamma
        self.decoders, self.failed = {"default": base}, {}
        for d in set(self.DRAFTER.values()):
            try:
                self.decoders[d] = base.fork(drafter=d)
            except Exception as exc:  # noqa: BLE001 - a drafter the bundle cannot run is a result
                self.failed[d] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        self.settings = {"bundle": str(o.bundle), "gamma": self.k, "default": {"drafter": name, "gamma": self.default_gamma},
                         "ort_intra_op_threads": o.threads}

    def decode(self, mode: str, temperature: float, prompt: list[int], tokens: int, seed: int) -> Sample:
        gamma = {"autoregressive": 0, "default": self.default_gamma}.get(mode, "auto" if mode.endswith("adaptive") else self.k)
        drafter = "default" if mode in ("autoregressive", "default") else self.DRAFTER[mode]
        if drafter in self.failed:
            raise ModeUnavailable(self.failed[drafter])
        res = self.decoders[drafter].generate(prompt, max_new_tokens=tokens, gamma=gamma, temperature=temperature, seed=seed, ignore_eos=True)
        s = res.stats
        stats = {"target_passes": s.target_calls + 1, **({"draft_tokens_accepted": s.accepted, "draft_tokens_evaluated": s.drafted} if gamma else {})}
        return Sample(s.total_seconds - s.prefill_seconds, s.new_tokens, s.new_tokens, stats, res.tokens)

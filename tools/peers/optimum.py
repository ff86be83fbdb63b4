"""optimum-onnx ``ORTModelForCausalLM`` of the target (CPU EP), through transformers' ``generate``."""

from __future__ import annotations

from pathlib import Path

from peers.base import OUT, Peer, Sample, checkpoint_key, log
from peers.hf import hf_generate, pad_id


class OptimumPeer(Peer):
    """optimum-onnx ``ORTModelForCausalLM`` (CPU EP) of the target, autoregressive; exported once
    with ``export=True`` into ``.bench/peers/optimum/`` (keyed by the checkpoint)."""

    name = "optimum"
    modes = ("autoregressive",)

    def __init__(self, target: Path, threads: int) -> None:
        import onnxruntime as ort
        from optimum.onnxruntime import ORTModelForCausalLM

        cache = OUT / "optimum" / f"{target.resolve().name}-{checkpoint_key(target)}"
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        kw = dict(session_options=so, provider="CPUExecutionProvider")
        if not (cache / "model.onnx").is_file():
            log(f"optimum: exporting {target} -> {cache}")
            ORTModelForCausalLM.from_pretrained(target, export=True, **kw).save_pretrained(cache)
        self.model = ORTModelForCausalLM.from_pretrained(cache, **kw)
        self.pad = pad_id(target)
        self.settings = {"cache": str(cache), "ort_intra_op_threads": threads}

    @classmethod
    def from_args(cls, args) -> OptimumPeer:
        return cls(args.target, args.threads)

    def decode(self, mode: str, temperature: float, prompt: list[int], tokens: int, seed: int) -> Sample:
        clock, ids = hf_generate(self.model, prompt, tokens, temperature, seed, self.pad)
        return clock.sample(ids, {})

"""transformers ``generate`` on PyTorch CPU (autoregressive and assisted), and the streamer
clock that optimum's peer, which goes through the same ``generate``, shares."""

from __future__ import annotations

import json
import time
from pathlib import Path

from peers.base import Peer, Sample


class StepClock:
    """A ``generate`` streamer that timestamps each ``put``: the first is the prompt, the
    second the first new token(s) (after prefill); ``end`` marks the last."""

    def __init__(self) -> None:
        self.puts: list[tuple[float, int]] = []
        self.t_end: float | None = None

    def put(self, value) -> None:
        self.puts.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        self.t_end = time.perf_counter()

    def sample(self, ids: list[int], stats: dict[str, float]) -> Sample:
        """Decoding after the first new token(s): the time since, the tokens since."""
        if len(self.puts) < 2 or self.t_end is None:
            raise RuntimeError("generate did not stream its tokens; cannot split prefill from decoding")
        t_first, first = self.puts[1]
        return Sample(self.t_end - t_first, len(ids) - first, len(ids), stats, ids)


def hf_generation_config(tokens: int, temperature: float, pad: int | None):
    """Exactly ``tokens`` new tokens; greedy at T = 0, else pure sampling at T.

    EOS is ignored by giving ``generate`` no EOS id at all: ``min_new_tokens`` would be the
    usual way, but transformers 4.57's assisted generation refuses the MinLengthLogitsProcessor
    it turns into ("Passing `MinLengthLogitsProcessor` when using assisted_generation is
    disabled"), and both modes must be treated alike.
    """
    from transformers import GenerationConfig

    common = dict(max_new_tokens=tokens, eos_token_id=None, pad_token_id=pad)
    if temperature == 0:
        return GenerationConfig(do_sample=False, **common)
    return GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, **common)


def pad_id(model_dir: Path) -> int | None:
    """The checkpoint's pad token id, else its (first) EOS id: batch 1 never pads, but
    ``generate`` wants one."""
    cfg = json.loads((model_dir / "config.json").read_text())
    pad = cfg.get("pad_token_id")
    pad = cfg.get("eos_token_id") if pad is None else pad
    return pad[0] if isinstance(pad, list) else pad


def hf_generate(model, prompt: list[int], tokens: int, temperature: float, seed: int, pad,
                **kwargs) -> tuple[StepClock, list[int]]:
    """One seeded ``generate`` call with a StepClock; returns the clock and the new tokens."""
    import torch

    ids = torch.tensor([prompt], dtype=torch.long)
    clock = StepClock()
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), streamer=clock,
                             use_model_defaults=False,  # keep the model's EOS out
                             generation_config=hf_generation_config(tokens, temperature, pad), **kwargs)
    return clock, out[0, len(prompt):].tolist()


class HFPeer(Peer):
    """transformers ``generate`` on PyTorch CPU: autoregressive and assisted (draft) decoding."""

    name = "hf"
    modes = ("autoregressive", "assisted")

    def __init__(self, target: Path, draft: Path, threads: int, draft_tokens: int | None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        load = dict(torch_dtype=torch.float32)  # CPU: fp32 compute, as the ORT peers
        self.target = AutoModelForCausalLM.from_pretrained(target, **load).eval()
        self.draft = AutoModelForCausalLM.from_pretrained(draft, **load).eval()
        self.pad = pad_id(target)
        self.target_passes = 0
        self.target.register_forward_hook(self._count)
        gc = self.draft.generation_config
        if draft_tokens is not None:
            gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold = draft_tokens, "constant", 0.0
        # transformers adapts these across calls; restore them per request so order does not matter.
        self.assistant_settings = (gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold)
        self.settings = {"num_assistant_tokens": gc.num_assistant_tokens, "schedule": gc.num_assistant_tokens_schedule,
                         "assistant_confidence_threshold": gc.assistant_confidence_threshold, "torch_threads": threads}

    @classmethod
    def from_args(cls, args) -> HFPeer:
        return cls(args.target, args.draft, args.threads, args.draft_tokens)

    def _count(self, *_args) -> None:
        self.target_passes += 1

    def decode(self, mode: str, temperature: float, prompt: list[int], tokens: int, seed: int) -> Sample:
        """One request; assisted mode also counts the target's forward passes."""
        kwargs = {}
        if mode == "assisted":
            gc = self.draft.generation_config
            gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold = self.assistant_settings
            kwargs["assistant_model"] = self.draft
        self.target_passes = 0
        clock, ids = hf_generate(self.target, prompt, tokens, temperature, seed, self.pad, **kwargs)
        stats = {"target_passes": float(self.target_passes)} if mode == "assisted" else {}
        return clock.sample(ids, stats)

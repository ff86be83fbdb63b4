"""A transformers ``generate`` of exactly N new tokens, timed from the first new token to the last.

Shared by the transformers peer (``local.py``, in specdec's python) and the optimum peer
(``worker.py optimum``, in its own venv): it needs only torch and transformers.
"""

from __future__ import annotations

import inspect
import time


class StepClock:
    """A ``generate`` streamer timing each ``put`` (the prompt, then each step's new tokens) and the ``end``."""

    def __init__(self) -> None:
        self.puts, self.t_end = [], None

    def put(self, value) -> None:
        self.puts.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        self.t_end = time.perf_counter()


def timed_generate(model, prompt: list[int], tokens: int, temperature: float, seed: int, pad: int | None, **kwargs) -> tuple[float, int, list[int]]:
    """One seeded ``generate`` of exactly ``tokens`` new tokens: (decoding seconds after the first new
    token(s), tokens decoded in them, all new ids). EOS is ignored by giving no EOS id (4.57's assisted
    generation refuses ``min_new_tokens``' MinLengthLogitsProcessor)."""
    import torch
    from transformers import GenerationConfig

    common = dict(max_new_tokens=tokens, eos_token_id=None, pad_token_id=pad)
    config = (GenerationConfig(do_sample=False, **common) if temperature == 0 else
              GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, **common))
    ids, clock = torch.tensor([prompt], dtype=torch.long), StepClock()
    if "use_model_defaults" in inspect.signature(model.generate).parameters:  # 4.57: the model's own config (its EOS) stays out
        kwargs = {**kwargs, "use_model_defaults": False}
    else:  # 5.x fills only what ``config`` leaves None from the model's own config: its EOS is cleared there
        model.generation_config.eos_token_id = None
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), streamer=clock, generation_config=config, **kwargs)
    new = out[0, len(prompt):].tolist()
    if len(clock.puts) < 2 or clock.t_end is None:
        raise RuntimeError("generate did not stream its tokens; cannot split prefill from decoding")
    t_first, first = clock.puts[1]
    return clock.t_end - t_first, len(new) - first, new

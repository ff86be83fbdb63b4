"""A training run that goes on where it stopped (``train-drafter --checkpoint FILE``): fit's whole state in one file.

    state   the head's trainable weights and its draft vocabulary, AdamW's moments, the step
            reached and the run's planned step count, the batch order's generator and the
            epoch's batches not yet taken, torch's generator (the context noise), the loss log,
            the held-out figures before the first step, the seconds trained so far
    key     the recipe and the data's shape (sequences, tokens, feature width): a checkpoint of
            another recipe or corpus is refused in one line, never read into this run

Written whole or not at all (specdec/atomic.py), every ``EVERY_SECONDS`` of training, when a run
stops at its time and on Ctrl-C: a run killed outright loses at most that much. A run resumed
from it takes the same steps the uninterrupted run would have taken, bit for bit on one machine
(tests/test_distill.py).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from specdec.errors import ConfigError

EVERY_SECONDS = 600.0


def run_key(recipe, train_seqs) -> dict:
    """What must match for a checkpoint to go on: the recipe and the training data's shape."""
    width = int(train_seqs.feats[0].shape[-1]) if train_seqs.feats else 0
    return {"recipe": asdict(recipe), "sequences": len(train_seqs), "tokens": int(train_seqs.tokens), "feature_width": width}


def save(path: Path, key: dict, head, opt, progress: dict, rng: np.random.Generator, order: list) -> None:
    """The state after ``progress["step"]`` steps into ``path``, atomically."""
    from specdec.atomic import write_atomic

    state = {
        "key": key,
        "weights": {n: p.detach().cpu() for n, p in head.named_parameters() if p.requires_grad},
        "vocab_ids": head.vocab_ids.detach().cpu(),
        "optimizer": opt.state_dict(),
        "progress": progress,
        "batch_rng": rng.bit_generator.state,
        "order": [np.asarray(b) for b in order],
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None,
    }
    write_atomic(Path(path), lambda fh: torch.save(state, fh))


def load(path: Path, key: dict, head, opt, rng: np.random.Generator, device: str) -> tuple[dict, list] | None:
    """(progress, the epoch's remaining batches) from ``path`` into ``head``, ``opt`` and ``rng``;
    None where no file is there yet (a first run)."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: named, not a traceback
        raise ConfigError(f"--checkpoint {path}: not a train-drafter checkpoint ({type(e).__name__}); pass another file or remove it to start over") from None
    if not isinstance(state, dict) or "key" not in state:
        raise ConfigError(f"--checkpoint {path}: not a train-drafter checkpoint; pass another file or remove it to start over")
    if state["key"] != key:
        diff = sorted(_differences(state["key"], key))
        raise ConfigError(f"--checkpoint {path}: saved by a run with other {', '.join(diff)} than this one's; "
                          "rerun with that run's settings and corpus, or pass another file to start over")  # fmt: skip
    if not torch.equal(state["vocab_ids"], head.vocab_ids.detach().cpu()):
        raise ConfigError(f"--checkpoint {path}: its head drafts another vocabulary than this run's; pass another file to start over")
    params = dict(head.named_parameters())
    with torch.no_grad():
        for name, value in state["weights"].items():
            params[name].copy_(value.to(params[name].device))
    opt.load_state_dict(state["optimizer"])
    rng.bit_generator.state = state["batch_rng"]
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] is not None and device.startswith("cuda"):
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return state["progress"], list(state["order"])


def _differences(saved: dict, now: dict) -> list[str]:
    """The names that differ: recipe fields by name, else the data's shape entries."""
    names = [f"--{k.replace('_', '-')} ({saved['recipe'][k]} there, {v} here)" for k, v in now["recipe"].items() if saved["recipe"].get(k) != v]
    return names + [f"{k} ({saved.get(k)} there, {v} here)" for k, v in now.items() if k != "recipe" and saved.get(k) != v]

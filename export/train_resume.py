"""A training run's time and its resumption (``train-drafter --train-minutes M --checkpoint FILE``).

    Budget  the run's steps against its time: the step count fit to it, or the run ended by it
    state   (with a checkpoint) fit's whole state in one file:
            the head's trainable weights and its draft vocabulary, AdamW's moments, the step
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

import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from specdec.errors import ConfigError

EVERY_SECONDS = 600.0


def fit_steps(step: int, elapsed: float, seconds: float, rate: float, cap: int) -> int:
    """The run's step count after ``step`` steps in ``elapsed`` s, for the rest of ``seconds``
    at ``rate`` s a step: at least one more step, at most ``cap``."""
    return max(step + 1, min(cap, step + int((seconds - elapsed) / rate)))


WARM, CALIBRATE, RECALIBRATE = 10, 40, 50  # a time-bounded fit times steps WARM..CALIBRATE, then sets its step count; again every RECALIBRATE steps


class Budget:
    """A run's steps against its ``seconds``: ``fit`` (no checkpoint) sets the step count from
    the rate of steps WARM..CALIBRATE and again every RECALIBRATE steps (``fit_steps``); else the
    time only ends the run (``over``), the schedule staying the recipe's."""

    def __init__(self, seconds: float | None, fit: bool, cap: int, report: Callable[[str], None]):
        self.seconds, self.fit, self.cap, self.report = seconds, fit and seconds is not None, cap, report
        self.t0 = self.t_warm = self.t_mark = time.perf_counter()

    def steps(self, step: int, steps: int) -> int:
        now = time.perf_counter()
        if self.fit and step == WARM:
            self.t_warm = now
        elif self.fit and step == CALIBRATE:  # the first steps load kernels: not timed
            rate = (now - self.t_warm) / (CALIBRATE - WARM)
            steps = fit_steps(step, now - self.t0, self.seconds, rate, self.cap)
            self.report(f"{steps} steps fit {self.seconds:.0f} s at {1e3 * rate:.0f} ms a step")
            self.t_mark = now
        elif self.fit and step > CALIBRATE and (step - CALIBRATE) % RECALIBRATE == 0:
            steps = fit_steps(step, now - self.t0, self.seconds, (now - self.t_mark) / RECALIBRATE, self.cap)
            self.t_mark = now
        return steps

    def over(self) -> bool:
        return not self.fit and self.seconds is not None and time.perf_counter() - self.t0 >= self.seconds


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


def begin(path: Path | None, key: dict, head, opt, rng: np.random.Generator, device: str, steps: int, before, report) -> tuple[dict, list]:
    """(progress, the epoch's remaining batches) of a run: from the checkpoint at ``path`` where
    one is there (``load``), else a first run's (``before()``: the held-out figures before training)."""
    resumed = load(path, key, head, opt, rng, device) if path is not None else None
    if resumed is None:
        progress, order = {"step": 0, "steps": steps, "log": [], "before": before(), "seconds": 0.0, "runs": 0}, []
    else:
        progress, order = resumed
        report(f"training goes on from {path} at step {progress['step']}/{progress['steps']} ({progress['seconds']:.0f} s trained)")
    progress["runs"] += 1
    return progress, order


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

"""Self-distillation data on disk: shards of the target's answers, written whole or not at all.

    DIR/plan.json         the requests (topic, kind, prompt), the settings, the seed: fixed at the first run
    DIR/shard-00000.npz   answers in order of completion; per answer (concatenated, offsets [n + 1]):
        job          int32 [n]          index into the plan's jobs (prompt index, temperature)
        prompt       int32 [P]          prompt token ids through the chat template
        answer       int32 [A]          the target's answer tokens (its end-of-turn token included)
        top_id       int32 [A, K]       the target's K most likely next tokens at each answer position
        top_lp       float16 [A, K]     their log-probabilities (raw: before temperature)

A shard is written to a hidden temporary name and renamed (atomic on POSIX), so an interrupted run
leaves whole shards only; ``done_jobs`` is what a resumed run skips.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from specdec.atomic import write_atomic


@dataclass
class Answer:
    job: int
    prompt: list[int]
    answer: list[int]
    top_id: np.ndarray  # [A, K] int32
    top_lp: np.ndarray  # [A, K] float16


def shard_paths(folder: Path) -> list[Path]:
    return sorted(Path(folder).glob("shard-*.npz"))


def offsets(lengths: list[int]) -> np.ndarray:
    """[n + 1] int64: where each of n concatenated pieces starts (and the end)."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)  # [n + 1]


def write_shard(folder: Path, index: int, answers: list[Answer], compressed: bool = True) -> Path:
    """Write ``answers`` as shard ``index``, atomically (uncompressed for an archive that compresses better)."""
    path = Path(folder) / f"shard-{index:05d}.npz"
    save = np.savez_compressed if compressed else np.savez
    return write_atomic(path, lambda fh: save(
        fh,
        job=np.array([a.job for a in answers], np.int32),
        prompt=np.concatenate([np.asarray(a.prompt, np.int32) for a in answers]),
        prompt_at=offsets([len(a.prompt) for a in answers]),
        answer=np.concatenate([np.asarray(a.answer, np.int32) for a in answers]),
        answer_at=offsets([len(a.answer) for a in answers]),
        top_id=np.concatenate([a.top_id for a in answers]).astype(np.int32),
        top_lp=np.concatenate([a.top_lp for a in answers]).astype(np.float16),
    ))  # fmt: skip


def read_shard(path: Path) -> Iterator[Answer]:
    with np.load(path) as npz:
        z = {k: npz[k] for k in npz.files}  # each npz[k] reads and inflates the array again: once per shard, not per answer
    p, a = z["prompt_at"], z["answer_at"]
    for i, job in enumerate(z["job"]):
        yield Answer(int(job), z["prompt"][p[i] : p[i + 1]].tolist(), z["answer"][a[i] : a[i + 1]].tolist(),
                     z["top_id"][a[i] : a[i + 1]], z["top_lp"][a[i] : a[i + 1]])  # fmt: skip


def answers(folder: Path) -> Iterator[Answer]:
    for path in shard_paths(folder):
        yield from read_shard(path)


def done_jobs(folder: Path) -> tuple[set[int], int]:
    """(jobs answered, answer tokens) over the folder's whole shards."""
    jobs, tokens = set(), 0
    for path in shard_paths(folder):
        z = np.load(path)
        jobs.update(int(j) for j in z["job"])
        tokens += int(z["answer_at"][-1])
    return jobs, tokens

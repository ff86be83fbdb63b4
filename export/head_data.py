"""A feature head's training data: token sequences, which positions are trained on, and the target's features.

Two sources:

- a text corpus ("stdlib" or a folder of text files): windows of ``window`` tokens at random
  offsets of the files' concatenated tokens, every position trained on;
- a self-distillation folder (``specdec distill``, specdec/commands/distill/): one sequence per
  conversation, prompt + the target's answer, as the runtime sees it (fed from an empty
  cache); only the positions that predict answer tokens are trained on, as EAGLE trains on
  assistant turns. Conversations of topics whose salted sha256 is 0 mod 32 are the held-out ones
  for the teacher-forced figures (the benchmark's held-out topics were never generated).

Batches group sequences of similar length (little padding); the features are the bundle's own
target graph's (ONNX Runtime, float32: the model the runtime serves), kept float16.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from specdec.atomic import write_atomic
from specdec.errors import ConfigError

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".c", ".h", ".js", ".ts", ".go", ".rs", ".java")


@dataclass
class Sequences:
    ids: list[np.ndarray]  # each [T_i] int64
    mask: list[np.ndarray]  # each [T_i] bool: position j is trained on (it predicts token j + 1)
    feats: list[np.ndarray] | None = None  # each [T_i, d] float16, after ``with_features``
    top: list[tuple[np.ndarray, np.ndarray]] | None = None  # each: the target's top-K ids [A_i, K] and log-probabilities at the trained positions, in order

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def tokens(self) -> int:
        return int(sum(len(x) for x in self.ids))

    @property
    def trained(self) -> int:
        return int(sum(m.sum() for m in self.mask))


def corpus_files(corpus: str) -> tuple[list[Path], list[Path]]:
    """(training, held-out) files: "stdlib" is the demo pair's split; a folder gives its text files,
    every 20th (by sorted path) held out."""
    if corpus == "stdlib":
        from specdec.held_out import stdlib_files

        return stdlib_files(held_out=False), stdlib_files(held_out=True)
    root = Path(corpus)
    files = sorted(f for f in root.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES) if root.is_dir() else []
    if len(files) < 2:
        raise ConfigError(f"--corpus {corpus}: expected 'stdlib', a `specdec distill` folder, or a folder with at least 2 text files "
                          f"({', '.join(TEXT_SUFFIXES)})")  # fmt: skip
    return [f for i, f in enumerate(files) if i % 20 != 19], [f for i, f in enumerate(files) if i % 20 == 19] or files[-1:]


def windows_of(files: list[Path], encode: Callable[[str], list[int]], window: int, count: int, rng: np.random.Generator,
               sep: int | None) -> Sequences:  # fmt: skip
    """``count`` windows of ``window`` tokens at random offsets of the files' concatenated tokens."""
    ids: list[int] = []
    for f in files:
        ids += encode(f.read_text(encoding="utf-8", errors="replace")) + ([sep] if sep is not None else [])
    stream = np.asarray(ids, dtype=np.int64)
    if len(stream) <= window:
        raise ConfigError(f"the corpus has {len(stream)} tokens; a training window takes {window + 1}")
    starts = rng.integers(0, len(stream) - window, count)
    seqs = [stream[s : s + window] for s in starts]
    return Sequences(seqs, [np.ones(window, bool) for _ in seqs])


def is_distilled(corpus: str) -> bool:
    return (Path(corpus) / "plan.json").is_file()


def held_out_topic(topic: str) -> bool:
    """A distilled conversation is held out when the sha256 of "eval/" + its topic is 0 mod 32
    (salted: `specdec distill` already leaves out the topics whose plain sha256 is 0 mod 8)."""
    return int(hashlib.sha256(f"eval/{topic}".encode()).hexdigest(), 16) % 32 == 0


def conversation(a, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """A distilled answer's prompt + answer ids [T] int64, cut to ``max_len``, and the mask [T] of
    the positions trained on: those predicting an answer token."""
    ids = np.asarray(a.prompt + a.answer, np.int64)[:max_len]
    mask = np.zeros(len(a.prompt) + len(a.answer), bool)
    mask[len(a.prompt) - 1 : len(a.prompt) + len(a.answer) - 1] = True
    return ids, mask[: len(ids)]


def distilled(folder: str, max_len: int, limit: int | None = None, features: dict[int, np.ndarray] | None = None) -> tuple[Sequences, Sequences]:
    """(training, held-out) conversations of a ``specdec distill`` folder, each cut to ``max_len``
    tokens; ``features``: job -> its features [T, d], where they were computed with the answers
    (specdec/commands/distill/hf.py), attached as ``with_features`` would."""
    from specdec.shards import answers

    plan = json.loads((Path(folder) / "plan.json").read_text())
    reqs, temps = plan["requests"], plan["settings"]["temperatures"]
    train, held = Sequences([], [], top=[]), Sequences([], [], top=[])
    if features is not None:
        train.feats, held.feats = [], []
    for a in answers(Path(folder)):
        ids, mask = conversation(a, max_len)
        side = held if held_out_topic(reqs[a.job // len(temps)]["topic"]) else train
        side.ids.append(ids)
        side.mask.append(mask)
        n = int(side.mask[-1].sum())
        side.top.append((a.top_id[:n], a.top_lp[:n]))
        if features is not None:
            side.feats.append(features[a.job][: len(ids)])
        if limit is not None and len(train) >= limit:
            break
    if not len(train) or not len(held):
        raise ConfigError(f"--corpus {folder}: {len(train)} training and {len(held)} held-out conversations; run specdec distill longer")
    return train, held


def model_key(manifest) -> str:
    """What the features depend on besides the tokens: the target graph and its weights (their digests)."""
    g = manifest.graphs[manifest.graph("target", "dynamic")[0]]
    h = hashlib.sha256(g.sha256.encode())
    for f in g.data:
        h.update(str(manifest.integrity["files"].get(f, f)).encode())
    return h.hexdigest()[:16]


def sequence_key(ids: np.ndarray) -> str:
    return hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()[:24]


def with_features(bundle: Path, manifest, seqs: Sequences, report: Callable[[str], None], cache: Path | None = None) -> Sequences:
    """``seqs`` with the target's features [T_i, d] float16 for each (fed from an empty cache).
    ``cache``: a folder where each conversation's are kept (``<cache>/<model_key>/<sequence_key>.npy``)
    and read back next time, so a run on a grown ``distill`` folder computes only the new ones."""
    folder = Path(cache) / model_key(manifest) if cache is not None else None
    paths = [folder / f"{sequence_key(ids)}.npy" for ids in seqs.ids] if folder is not None else [None] * len(seqs)
    feats: list[np.ndarray | None] = [np.load(p) if p is not None and p.is_file() else None for p in paths]
    missing = [i for i, f in enumerate(feats) if f is None]
    if len(missing) < len(seqs):
        report(f"target features read from {folder}: {len(seqs) - len(missing)} of {len(seqs)} conversations")
    if missing:
        computed = _compute_features(bundle, manifest, Sequences([seqs.ids[i] for i in missing], [], None, None), report)
        for i, f in zip(missing, computed.feats):
            feats[i] = f
            if folder is not None:
                folder.mkdir(parents=True, exist_ok=True)
                write_atomic(paths[i], lambda fh, f=f: np.save(fh, f))
    return Sequences(seqs.ids, seqs.mask, feats, seqs.top)


def _compute_features(bundle: Path, manifest, seqs: Sequences, report: Callable[[str], None]) -> Sequences:
    from specdec.engines.kv import KVCache
    from specdec.engines.ort import runner_for

    name, g = manifest.graph("target", "dynamic")
    t = manifest.target
    cache = KVCache(t.num_layers, t.num_kv_heads, manifest.max_seq_len, t.head_dim, manifest.dtype)
    runner = runner_for(bundle, name, g, cache)
    feats, t0, done = [], time.perf_counter(), 0
    for i, ids in enumerate(seqs.ids):
        cache.rewind_to(0)
        runner.run(ids)
        feats.append(runner.features[0, : len(ids)].astype(np.float16))
        done += len(ids)
        if (i + 1) % 200 == 0:
            el = time.perf_counter() - t0
            report(f"target features {i + 1}/{len(seqs)} sequences, {done:,} tokens ({el:.0f} s, {done / el:.0f} tok/s)")
    return Sequences(seqs.ids, seqs.mask, feats, seqs.top)


def batches(seqs: Sequences, tokens: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Index groups of similar length, each at most ``tokens`` tokens once padded, in random order."""
    order = np.argsort([len(x) for x in seqs.ids], kind="stable")
    groups, cur, longest = [], [], 0
    for i in order:
        n = len(seqs.ids[i])
        if cur and max(longest, n) * (len(cur) + 1) > tokens:
            groups.append(np.array(cur))
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        groups.append(np.array(cur))
    rng.shuffle(groups)
    return groups


def collate(seqs: Sequences, idx: np.ndarray) -> tuple[np.ndarray, ...]:
    """ids [B, T] int64, mask [B, T] bool, features [B, T, d] float32 (d = 0 without features), right-padded with
    zeros (mask False); with top-K labels also top_id [B, T, K] int64 (-1 where none) and top_p [B, T, K] float32."""
    T = max(len(seqs.ids[i]) for i in idx)
    d = seqs.feats[idx[0]].shape[-1] if seqs.feats is not None else 0
    ids = np.zeros((len(idx), T), np.int64)  # [B, T]
    mask = np.zeros((len(idx), T), bool)  # [B, T]
    f = np.zeros((len(idx), T, d), np.float32)  # [B, T, d]
    for b, i in enumerate(idx):
        n = len(seqs.ids[i])
        ids[b, :n], mask[b, :n] = seqs.ids[i], seqs.mask[i]
        if d:
            f[b, :n] = seqs.feats[i]
    if seqs.top is None:
        return ids, mask, f
    K = seqs.top[idx[0]][0].shape[-1]
    top_id = np.full((len(idx), T, K), -1, np.int64)  # [B, T, K]
    top_p = np.zeros((len(idx), T, K), np.float32)  # [B, T, K]
    for b, i in enumerate(idx):
        at = np.flatnonzero(mask[b])
        top_id[b, at], top_p[b, at] = seqs.top[i][0], np.exp(seqs.top[i][1].astype(np.float32))
    return ids, mask, f, top_id, top_p

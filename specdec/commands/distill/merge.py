"""One corpus from several ``specdec distill`` folders: a drafter trains on all of them at once.

    first source   every request and shard as it is: its jobs keep their numbers, so a features
                   cache made for it (tools/gpu/drafter.py --features-cache) stays valid
    other sources  their answered requests only, appended; each answer's job renumbered to
                   (its request's new index, its temperature's index among the first's)
    prompts.npz    written when the first source has one (tools/gpu/drafter.py answers from it):
                   an appended request's prompt ids are those its answers were made from

The sources must agree on what an answer is (longest answer, top-K, longest prompt), and each
other source's temperatures must be among the first's. The sources are read, never changed; the
output is written to a temporary folder and renamed into place whole.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from specdec.atomic import build_atomic, write_atomic
from specdec.commands.distill.run import PLAN, PROMPTS, read_prompts
from specdec.shards import Answer, offsets, read_shard, shard_paths, write_shard
from specdec.errors import ConfigError

SAME = ("max_new_tokens", "top_k", "max_prompt_tokens")


def _plan(folder: Path) -> dict:
    path = folder / PLAN
    if not path.is_file():
        raise ConfigError(f"{folder}: no {PLAN}; expected a specdec distill folder (specdec distill BUNDLE --out {folder})")
    return json.loads(path.read_text())


def merge(sources: list[Path], out: Path, shard_size: int = 64) -> dict:
    """Merge ``sources`` (the first kept as it is) into the new folder ``out``; returns a record."""
    sources, out = [Path(s) for s in sources], Path(out)
    if len(sources) < 2:
        raise ConfigError(f"{len(sources)} source folder(s): expected two or more specdec distill folders to merge")
    if out.exists():
        raise ConfigError(f"--out {out} exists: expected a new folder (a merge never writes over a corpus)")
    plans = [_plan(s) for s in sources]
    first = plans[0]["settings"]
    temps = [float(t) for t in first["temperatures"]]
    for src, plan in zip(sources[1:], plans[1:]):
        s = plan["settings"]
        for key in SAME:
            if s.get(key) != first.get(key):
                raise ConfigError(f"{src}: {key} {s.get(key)} where {sources[0]} has {first.get(key)}; expected the same answers' shape: "
                                  f"make it with the first's --{key.replace('_', '-')}")  # fmt: skip
        extra = [t for t in s["temperatures"] if float(t) not in temps]
        if extra:
            raise ConfigError(f"{src}: temperatures {extra} are not among {sources[0]}'s {temps}; expected a subset: put the folder with "
                              "every temperature first")  # fmt: skip
    record = build_atomic(out, lambda tmp: _write(sources, plans, temps, tmp, shard_size))  # nothing half-written is left behind
    return {"out": str(out), **record}


def _write(sources: list[Path], plans: list[dict], temps: list[float], tmp: Path, shard_size: int) -> dict:
    """The merged folder's files into ``tmp``; returns the record's counts."""
    requests = list(plans[0]["requests"])
    shard = 0
    for path in shard_paths(sources[0]):  # the first's shards unchanged: hard links where the file system allows
        dest = tmp / f"shard-{shard:05d}.npz"
        try:
            os.link(path, dest)
        except OSError:
            shutil.copy2(path, dest)
        shard += 1
    extra_prompts: list[np.ndarray] = []
    added = []
    for src, plan in zip(sources[1:], plans[1:]):
        src_temps = [float(t) for t in plan["settings"]["temperatures"]]
        kept: dict[int, int] = {}  # the source's request index -> the merged plan's
        pending: list[Answer] = []
        n_answers = tokens = 0
        for a in (a for p in shard_paths(src) for a in read_shard(p)):
            r = a.job // len(src_temps)
            if r not in kept:
                kept[r] = len(requests)
                requests.append({**plan["requests"][r], "source": str(src)})
                extra_prompts.append(np.asarray(a.prompt, np.int32))
            a.job = kept[r] * len(temps) + temps.index(src_temps[a.job % len(src_temps)])
            pending.append(a)
            n_answers, tokens = n_answers + 1, tokens + len(a.answer)
            if len(pending) >= shard_size:
                write_shard(tmp, shard, pending)
                shard, pending = shard + 1, []
        if pending:
            write_shard(tmp, shard, pending)
            shard += 1
        added.append({"folder": str(src), "requests": len(kept), "answers": n_answers, "answer_tokens": tokens, "settings": plan["settings"]})
    merged = {**plans[0], "requests": requests, "merged": {"first": str(sources[0]), "added": added}}
    write_atomic(tmp / PLAN, lambda fh: fh.write(json.dumps(merged, indent=1).encode()))
    if (sources[0] / PROMPTS).is_file():
        ids, eos, max_seq = read_prompts(sources[0])
        ids = ids + extra_prompts
        write_atomic(tmp / PROMPTS, lambda fh: np.savez_compressed(
            fh, prompt=np.concatenate(ids), prompt_at=offsets([len(x) for x in ids]), eos=np.asarray(eos, np.int32), max_seq_len=np.int64(max_seq)))  # fmt: skip
    return {"requests": len(requests), "shards": shard, "added": [{k: v for k, v in a.items() if k != "settings"} for a in added]}

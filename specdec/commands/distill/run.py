"""``specdec distill``: the target answers varied prompts through its chat template, on our BatchEngine;
its answers and top-K log-probabilities become a drafter's training data (specdec/shards.py).

    plan      the training side of the topic split (specdec/commands/distill/prompts.py); self-instruct
              requests first: the target writes a question per topic, kept when it looks like one
    jobs      job j = (request j // T, temperature j % T) over ``temperatures`` (greedy and T = 1 by
              default: two answers per prompt, the second a sample of the target's law)
    generate  jobs not answered yet, up to ``max_batch`` at once (γ = 0: the target alone), each
              with a seed of its own; a shard is written every ``shard_size`` answers
    stop      at ``tokens`` answer tokens, after ``minutes``, or when every job is answered;
              an interrupted run resumes where its last whole shard ended

The log-probabilities are the bundle's target's (raw, before temperature): train from a float32
bundle's data, or measure what a quantized bundle's differ (``--bundle`` of ``specdec distill``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from specdec.atomic import write_atomic
from specdec.commands.distill import prompts as P
from specdec.shards import Answer, done_jobs, offsets, shard_paths, write_shard
from specdec.errors import ConfigError

PLAN = "plan.json"
PROMPTS = "prompts.npz"  # --plan-only: every request's prompt ids through the chat template, for a generator elsewhere


@dataclass(frozen=True)
class Settings:
    max_new_tokens: int = 256
    temperatures: tuple[float, ...] = (0.0, 1.0)
    top_k: int = 20  # log-probabilities kept per answer position (the runtime's logprobs bound)
    seed: int = 0
    docs: int = 1500  # coding requests made from installed docstrings
    forms: str = "templates"  # the request forms (specdec/commands/distill/prompts.py FORM_SETS)
    shard_size: int = 64
    max_prompt_tokens: int = 512
    requests: list[dict] = field(default_factory=list, compare=False)  # given: these instead of the topic split's (tests)


def _template(bundle: Path, engine):
    """The bundle's chat template; self-distillation asks the target through it."""
    from specdec.serve.chat import bundle_template

    chat = bundle_template(bundle, engine.manifest, engine.codec)
    if chat is None:
        raise ConfigError(f"bundle {bundle} has no chat template; self-distillation asks the target through it: export a tokenizer that has one")
    return chat


def _chat(bundle: Path, engine, chat=None):
    """text -> the ids of a user turn holding it, through ``chat`` (default: the bundle's template)."""
    chat = chat or _template(bundle, engine)
    return lambda text: engine.codec.encode(chat.render([{"role": "user", "content": text}]))


def _user_prefix(chat, codec) -> list[int]:
    """The chat template's ids up to where a user turn's text begins (Magpie): what the target
    continues with a user request of its own."""
    mark = "\x00user-turn\x00"
    text = chat.render([{"role": "user", "content": mark}])
    return codec.encode(text[: text.index(mark)])


def _wait_all(engine, jobs: list[tuple[int, list[int], dict]], on_done: Callable) -> None:
    """Submit (key, prompt ids, params) to ``engine`` keeping 2 × ``max_batch`` in flight (a queued
    request takes a slot as soon as one frees), calling on_done(key, prompt ids, result) in submission order."""
    from collections import deque

    flight: deque = deque()
    for key, ids, params in jobs:
        flight.append((key, ids, engine.submit(ids, block=True, **params)))
        while len(flight) >= 2 * engine.max_batch:
            k, i, h = flight.popleft()
            on_done(k, i, h.result())
    while flight:
        k, i, h = flight.popleft()
        on_done(k, i, h.result())


def make_plan(folder: Path, bundle: Path, engine, s: Settings, report: Callable[[str], None]) -> dict:
    """The plan (requests with prompts resolved), made once: self-instruct questions are the target's."""
    path = folder / PLAN
    if path.is_file():
        plan = json.loads(path.read_text())
        if {**_settings_record(Settings()), **plan["settings"]} != _settings_record(s):  # a setting newer than the plan: its default then
            raise ConfigError(f"{folder} holds a run with other settings ({plan['settings']}); resume it with those or use another --out")
        return plan
    chat = _template(bundle, engine)
    encode = _chat(bundle, engine, chat)
    reqs = s.requests or P.requests(held_out=False, seed=s.seed, docs=s.docs, forms=s.forms)
    instruct = [(i, r) for i, r in enumerate(reqs) if "instruct" in r or "user_turn" in r]
    written: dict[int, str] = {}

    def keep(i, _, res):
        looks = P.looks_like_request if "user_turn" in reqs[i] else P.looks_like_question
        if looks(res.text or ""):
            written[i] = res.text.strip().strip('"')

    prefix = _user_prefix(chat, engine.codec) if any("user_turn" in r for _, r in instruct) else None
    asked = lambda r: encode(r["instruct"]) if "instruct" in r else prefix  # noqa: E731  # a user turn: the template up to its text

    report(f"self-instruct: the target writes {len(instruct)} questions or user turns")
    _wait_all(engine, [(i, asked(r), dict(max_new_tokens=64 if "user_turn" in r else 48, temperature=1.0, seed=s.seed + i, gamma=0))
                       for i, r in instruct], keep)  # fmt: skip
    final = []
    for i, r in enumerate(reqs):
        if "instruct" in r or "user_turn" in r:
            if i in written:
                final.append({"topic": r["topic"], "kind": r["kind"], "prompt": written[i], "self_instruct": True})
        else:
            final.append(r)
    plan = {"settings": _settings_record(s), "bundle": str(bundle), "requests": final,
            "self_instruct": {"asked": len(instruct), "kept": len(written)}}  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda fh: fh.write(json.dumps(plan, indent=1).encode()))
    report(f"plan: {len(final)} requests ({len(written)} of {len(instruct)} self-instruct questions kept) -> {path}")
    return plan


def plan_only(bundle: Path, out: Path, s: Settings, max_batch: int, report: Callable[[str], None] = print) -> dict:
    """Make the plan (self-instruct questions included: the target writes them here) and write
    every request's prompt ids through the bundle's chat template to ``out/prompts.npz``, with the
    ids that end an answer: what a generator elsewhere (tools/gpu/drafter.py, transformers on a
    GPU) needs to answer the jobs and write shards this folder reads as its own. Returns a summary."""
    from specdec.runtime.batch import BatchEngine

    bundle, out = Path(bundle), Path(out)
    with BatchEngine(bundle, max_batch=max_batch, drafter="lookup", max_queue=4 * max_batch) as engine:
        plan = make_plan(out, bundle, engine, s, report)
        encode = _chat(bundle, engine)
        ids = [np.asarray(encode(r["prompt"]), np.int32) for r in plan["requests"]]
        eos = np.asarray(engine.manifest.eos_token_ids, np.int32)
        max_seq = engine.manifest.max_seq_len
    write_atomic(out / PROMPTS, lambda fh: np.savez_compressed(
        fh, prompt=np.concatenate(ids), prompt_at=offsets([len(x) for x in ids]), eos=eos, max_seq_len=np.int64(max_seq)))  # fmt: skip
    jobs = len(ids) * len(s.temperatures)
    report(f"{out / PROMPTS}: {len(ids)} prompts ({jobs} jobs at temperatures {list(s.temperatures)}), end ids {eos.tolist()}")
    return {"requests": len(ids), "jobs": jobs, "eos": eos.tolist()}


def read_prompts(folder: Path) -> tuple[list[np.ndarray], list[int], int]:
    """``plan_only``'s prompt ids (one array per request of the plan), answer-ending ids and the
    bundle's max-seq-len."""
    z = np.load(Path(folder) / PROMPTS)
    at = z["prompt_at"]
    return [z["prompt"][at[i] : at[i + 1]] for i in range(len(at) - 1)], z["eos"].tolist(), int(z["max_seq_len"])


def _settings_record(s: Settings) -> dict:
    d = asdict(s)
    d.pop("requests")
    d["temperatures"] = list(d["temperatures"])
    return d


def distill(bundle: Path, out: Path, s: Settings, max_batch: int, tokens: int | None = None, minutes: float | None = None,
            progress: bool = True, report: Callable[[str], None] = print) -> dict:  # fmt: skip
    """Run (or resume) self-distillation of ``bundle``'s target into ``out``; returns the run's record."""
    from tqdm import tqdm

    from specdec.runtime.batch import BatchEngine

    bundle, out = Path(bundle), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with BatchEngine(bundle, max_batch=max_batch, drafter="lookup", max_queue=4 * max_batch) as engine:
        plan = make_plan(out, bundle, engine, s, report)
        encode = _chat(bundle, engine)
        reqs, temps = plan["requests"], s.temperatures
        done, have = done_jobs(out)
        todo = [j for j in range(len(reqs) * len(temps)) if j not in done]
        bar = tqdm(total=tokens, initial=have, unit="tok", desc="answer tokens", disable=not progress, smoothing=0.05)
        shard, pending, made = len(shard_paths(out)), [], 0
        state = {"tokens": have, "stop": False}

        def jobs():
            for j in todo:
                if state["stop"]:
                    return
                r = reqs[j // len(temps)]
                ids = encode(r["prompt"])
                if len(ids) > s.max_prompt_tokens:
                    continue
                yield j, ids, dict(max_new_tokens=s.max_new_tokens, temperature=temps[j % len(temps)], seed=s.seed * 1_000_003 + j,
                                   gamma=0, logprobs=s.top_k)  # fmt: skip

        def on_done(j, prompt, res):
            nonlocal shard, made
            if res.stats.finish_reason not in ("eos", "length"):  # cancelled: not a whole answer
                return
            pending.append(_answer(j, prompt, res, s.top_k))
            state["tokens"] += len(res.tokens)
            bar.update(len(res.tokens))
            if len(pending) >= s.shard_size:
                write_shard(out, shard, pending)
                shard, made = shard + 1, made + len(pending)
                pending.clear()
            if (tokens is not None and state["tokens"] >= tokens) or (minutes is not None and time.perf_counter() - t0 > 60 * minutes):
                state["stop"] = True

        interrupted = False
        try:
            _wait_all(engine, jobs(), on_done)
        except KeyboardInterrupt:  # Ctrl-C: keep what is whole, say how to go on
            interrupted = True
        finally:
            if pending:
                write_shard(out, shard, pending)
                made += len(pending)
                pending.clear()
            bar.close()
    return _record(out, len(reqs) * len(temps), interrupted, made, have, time.perf_counter() - t0)


def _answer(j: int, prompt, res, top_k: int) -> Answer:
    """A finished request as an Answer: its tokens, and each one's top-K alternatives and their log-probabilities."""
    top = res.logprobs  # one TokenLogprob per answer token, its top-K alternatives
    ids = np.array([[t for t, _ in x.top] for x in top], np.int32).reshape(len(top), top_k)  # [A, K]
    lps = np.array([[lp for _, lp in x.top] for x in top], np.float16).reshape(len(top), top_k)  # [A, K]
    return Answer(j, list(prompt), list(res.tokens), ids, lps)


def _record(out: Path, jobs: int, interrupted: bool, made: int, have: int, seconds: float) -> dict:
    """The folder's totals and this run's (``made`` answers, from ``have`` tokens), written to progress.json."""
    done, have_now = done_jobs(out)
    record = {"answers": len(done), "answer_tokens": have_now, "jobs": jobs, "interrupted": interrupted, "this_run": {
        "answers": made, "answer_tokens": have_now - have, "seconds": round(seconds, 1), "tok_s": round((have_now - have) / seconds, 1)}}  # fmt: skip
    (out / "progress.json").write_text(json.dumps(record, indent=1))
    return record

"""Answering a distill plan with a transformers model, in batches: for a GPU, where our CPU engine
would take hours (tools/gpu/drafter.py).

``specdec distill --plan-only`` writes the plan and every request's prompt ids through the
bundle's chat template (prompts.npz); this module answers its jobs with the same target loaded
by transformers (float32), many rows per forward, and writes shards in the format
``specdec distill`` writes (specdec/shards.py), so ``train-drafter --corpus`` and
``export/head_data.py`` read them as their own. One pass gives all a head's training needs:

    prefill   the left-padded prompts [B, P]: each row's features (the last hidden state, which
              the LM head reads) at every prompt position
    decode    one token per row per forward, greedy or sampled at the job's temperature (a
              torch generator seeded per batch), until each row's answer ends at an end id or
              at ``max_new_tokens``; at each answer position the raw top-K log-probabilities
              (before temperature) and the feature that predicts the next token

What differs from ``specdec distill``: the sampled answers are draws from the same law, not the
same draws (another sampler); float32 sums of a padded batch differ from one row's in the last
bits. Greedy answers are the target's argmax loop (tests/test_distill.py checks them against
the bundle's own decoding).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from specdec.shards import Answer


def load_model(source, device: str = "cpu", tokenizer: bool = False):
    """A causal LM in float32, in eval mode on ``device``, from a GGUF file (dequantized by
    transformers) or a checkpoint folder; with ``tokenizer``, (its tokenizer, the model)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(source)
    where, kw = (str(source.parent), {"gguf_file": source.name}) if source.suffix.lower() == ".gguf" else (str(source), {})
    model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw).to(device).eval()
    return (AutoTokenizer.from_pretrained(where, **kw), model) if tokenizer else model


@dataclass
class Answered:
    answer: Answer
    feats: np.ndarray  # [P + A, d] float16: the feature at every position of prompt + answer


def jobs_by_batch(prompts: list[np.ndarray], temperatures: list[float], max_prompt: int, rows: int, skip: set[int] = frozenset(),
                  seed: int = 0) -> list[list[int]]:  # fmt: skip
    """Job ids (request j // T, temperature j % T) in batches of ``rows``: one temperature per
    batch, prompts of similar length together (less padding); prompts over ``max_prompt`` left out.
    The batches come in a seeded random order, so that a run stopped by time has answered every
    kind of request at every temperature, not the shortest greedy ones only."""
    t = len(temperatures)
    out = []
    for k in range(t):
        jobs = [j for j in range(len(prompts) * t) if j % t == k and j not in skip and len(prompts[j // t]) <= max_prompt]
        jobs.sort(key=lambda j: len(prompts[j // t]))
        out += [jobs[i : i + rows] for i in range(0, len(jobs), rows)]
    order = np.random.default_rng(seed).permutation(len(out))
    return [out[i] for i in order]


@torch.no_grad()
def answer_batch(model, jobs: list[int], prompts: list[np.ndarray], temperatures: list[float], eos: list[int], max_new_tokens: int,
                 top_k: int, seed: int) -> list[Answered]:  # fmt: skip
    """Answer ``jobs`` (one temperature) together; see the module docstring."""
    device = next(model.parameters()).device
    t = len(temperatures)
    temp = temperatures[jobs[0] % t]
    rows = [np.asarray(prompts[j // t], np.int64) for j in jobs]
    B, P = len(rows), max(len(r) for r in rows)
    ids = torch.zeros((B, P), dtype=torch.long)  # [B, P], left-padded
    mask = torch.zeros((B, P), dtype=torch.long)  # [B, P]
    for b, r in enumerate(rows):
        ids[b, P - len(r) :], mask[b, P - len(r) :] = torch.from_numpy(r), 1
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, P]: each row's own positions
    # logits at the last position only: all of them would be [B, P, V] float32 (13 GB at 128 rows of 512 tokens)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, output_hidden_states=True, logits_to_keep=1)
    past = out.past_key_values
    feats = [out.hidden_states[-1].float().cpu().numpy()]  # [B, P, d]: what the LM head read
    logits = out.logits[:, -1].float()  # [B, V]
    gen = torch.Generator(device=device).manual_seed(seed)
    ends = torch.tensor(eos, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    tokens, tops, lps = [], [], []
    nxt_pos = pos[:, -1]
    for _ in range(max_new_tokens):
        logp = torch.log_softmax(logits, -1)  # raw: the labels are before temperature
        top = logp.topk(top_k, -1)
        tops.append(top.indices.int().cpu())
        lps.append(top.values.half().cpu())
        if temp == 0:
            tok = logits.argmax(-1)
        else:
            tok = torch.multinomial(torch.softmax(logits / temp, -1), 1, generator=gen)[:, 0]
        tok = torch.where(done, ends[0], tok)  # a finished row feeds an end id, never read
        tokens.append(tok.cpu())
        done = done | torch.isin(tok, ends)
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=device)], -1)
        nxt_pos = nxt_pos + 1
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=nxt_pos[:, None], past_key_values=past, use_cache=True,
                    output_hidden_states=True)  # fmt: skip
        past = out.past_key_values
        feats.append(out.hidden_states[-1].float().cpu().numpy())  # [B, 1, d]
        logits = out.logits[:, -1].float()
    toks = torch.stack(tokens, 1).numpy()  # [B, A_max]
    top_id, top_lp = torch.stack(tops, 1).numpy(), torch.stack(lps, 1).numpy()  # [B, A_max, K]
    f = np.concatenate(feats, 1)  # [B, P + A_max - 1, d]
    answered = []
    for b, (j, r) in enumerate(zip(jobs, rows)):
        hit = np.flatnonzero(np.isin(toks[b], eos))
        n = int(hit[0]) + 1 if len(hit) else toks.shape[1]  # the end id kept, as specdec distill keeps it
        answer = Answer(j, r.tolist(), toks[b, :n].tolist(), top_id[b, :n].astype(np.int32), top_lp[b, :n])
        # features of the row's own positions, prompt + answer: its prompt's (after the padding),
        # then its answer tokens' but the last, whose feature (it would predict past the answer)
        # no training position reads: zeros there, as export/head_data.py's rows are [T, d]
        own = np.zeros((len(r) + n, f.shape[-1]), np.float16)  # [T, d]
        own[: len(r) + n - 1] = np.concatenate([f[b, P - len(r) : P], f[b, P : P + n - 1]])
        answered.append(Answered(answer, own))
    return answered


def answer_all(model, prompts: list[np.ndarray], temperatures: list[float], eos: list[int], max_new_tokens: int, rows: int,
               top_k: int = 20, seed: int = 0, max_prompt: int = 512, skip: set[int] = frozenset()) -> Iterator[Answered]:  # fmt: skip
    """Every job's answer, batch by batch (see ``jobs_by_batch``)."""
    for batch in jobs_by_batch(prompts, temperatures, max_prompt, rows, skip, seed):
        yield from answer_batch(model, batch, prompts, temperatures, eos, max_new_tokens, top_k, seed * 1_000_003 + batch[0])


@torch.no_grad()
def features(model, answers: list[Answer], rows: int, top_k: int = 0, bf16: bool = False, layers: tuple[int, ...] = ()) -> Iterator[tuple[int, np.ndarray, tuple | None]]:
    """(job, features [P + A, d] float16, labels) for answers made earlier or elsewhere (a corpus
    brought back from another machine): the LM head's input at every position of prompt + answer,
    from one forward per batch, zeros at the last position as ``answer_batch`` leaves it.

    ``top_k``: labels (top_id [A, K] int32, top_lp [A, K] float16, raw log-probabilities) at
    each answer position from the same forward, for a corpus that came back with fewer (else None).
    ``bf16``: the forward under bfloat16 autocast, for a CPU (2x faster on 2 AVX-512 cores; on
    SmolLM2-135M the features are 0.9% off float32's in norm and give the same top token at 99.1%
    of answer positions, well inside the 10%-of-RMS noise the head trains with).
    ``layers``: the hidden states after these decoder layers follow the LM head's input, f [P + A, (1 + len(layers)) d]
    (EAGLE-3's fused features: tools/train/fused_features.py)."""
    device = next(model.parameters()).device
    lm_head = model.get_output_embeddings()
    order = sorted(range(len(answers)), key=lambda i: len(answers[i].prompt) + len(answers[i].answer))  # similar lengths together
    for start in range(0, len(order), rows):
        batch = [answers[i] for i in order[start : start + rows]]
        seqs = [np.asarray(a.prompt + a.answer, np.int64) for a in batch]
        # [B, T], right-padded: causal attention keeps the padding out of every real position
        ids = torch.zeros((len(seqs), max(map(len, seqs))), dtype=torch.long)
        mask = torch.zeros_like(ids)  # [B, T]
        for b, r in enumerate(seqs):
            ids[b, : len(r)], mask[b, : len(r)] = torch.from_numpy(r), 1
        done = []
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):  # left before yielding: the caller's ops stay its own
            out = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True, logits_to_keep=1)
            h = out.hidden_states[-1]  # [B, T, d]
            for b, (a, r) in enumerate(zip(batch, seqs)):
                labels = None
                if top_k:
                    p = len(a.prompt)
                    logp = torch.log_softmax(lm_head(h[b, p - 1 : len(r) - 1]).float(), -1)  # [A, V]: what predicted each answer token
                    top = logp.topk(top_k, -1)
                    labels = (top.indices.int().cpu().numpy(), top.values.half().cpu().numpy())
                f = torch.cat([h[b, : len(r)], *(out.hidden_states[l][b, : len(r)] for l in layers)], -1).float().cpu().numpy().astype(np.float16)  # [P + A, d (1 + len(layers))]
                f[-1] = 0
                done.append((a.job, f, labels))
        yield from done


def earlier_features(model, data, feats: dict[int, np.ndarray], rows: int, report, relabel: int = 0, bf16: bool = False,
                     cache=None, layers: tuple[int, ...] = ()) -> dict:  # fmt: skip
    """Features, into ``feats``, for the answers in ``data`` that this run did not make (an earlier
    run's, or a corpus answered elsewhere): one forward each (``features``); tools/gpu/drafter.py's data.

    ``relabel``: answers with fewer top labels than this get the top-``relabel`` of the same
    forward, their shards written again (a corpus that came back with its top-1 only).
    ``cache``: a folder of each answer's features (and labels) as ``JOB.npz``, read back by a run
    that was stopped or trains again, so the forwards are paid once (~830 tok/s on this 2-core CPU in bfloat16).
    ``layers``: the auxiliary streams an EAGLE-3 head fuses follow the LM head's input (``features``)."""
    import json
    import time

    from tqdm import tqdm

    from specdec.atomic import write_atomic
    from specdec.errors import ConfigError
    from specdec.shards import read_shard, shard_paths

    earlier = [a for path in shard_paths(data) for a in read_shard(path) if a.job not in feats]
    labels: dict[int, tuple] = {}
    if cache is not None:  # features of one target, made one way: a cache of another is refused, not read
        cache.mkdir(parents=True, exist_ok=True)
        key = {"target": str(model.config._name_or_path), "width": model.config.hidden_size, "bf16": bf16, **({"layers": list(layers)} if layers else {})}
        meta = cache / "cache.json"
        if meta.is_file() and json.loads(meta.read_text()) != key:
            raise ConfigError(f"--features-cache {cache}: it holds features of {json.loads(meta.read_text())}, this run makes {key}; pass another folder")
        meta.write_text(json.dumps(key))
    todo = [a for a in earlier if not _cached(cache, a, relabel, feats, labels)]
    if cache is not None:
        report(f"features of {len(earlier) - len(todo)} earlier answers read from {cache}")
    t0 = time.perf_counter()
    k = relabel if any(a.top_id.shape[1] < relabel for a in todo) else 0
    with tqdm(total=sum(len(a.prompt) + len(a.answer) for a in todo), unit="tok", unit_scale=True, desc="features", mininterval=30, disable=not todo) as bar:
        for job, f, top in features(model, todo, rows, top_k=k, bf16=bf16, layers=layers):
            feats[job] = f
            if top is not None:
                labels[job] = top
            if cache is not None:  # whole files only: a stopped run resumes at the next answer
                write_atomic(cache / f"{job}.npz", lambda fh: np.savez(fh, f=f, **({"top_id": top[0], "top_lp": top[1]} if top is not None else {})))
            bar.update(len(f))
    seconds = time.perf_counter() - t0
    if todo:
        report(f"features of {len(todo)} earlier answers in {seconds:.0f} s ({sum(map(len, (feats[a.job] for a in todo))) / max(seconds, 1e-9):,.0f} tok/s)")
    relabeled = _relabel(data, labels, relabel) if relabel else 0
    if relabeled:
        report(f"{relabeled} answers relabeled with the top-{relabel} of this target's forward")
    return {"answers": len(earlier), "computed": len(todo), "seconds": round(seconds, 1), "bf16": bf16, "relabeled": relabeled}


def _cached(cache, a: Answer, relabel: int, feats: dict, labels: dict) -> bool:
    """Whether answer ``a``'s features (and labels, with as many as ``relabel`` asks) are in
    ``cache``: then they are put into ``feats`` and ``labels``."""
    hit = cache / f"{a.job}.npz" if cache else None
    if hit is None or not hit.is_file():
        return False
    with np.load(hit) as z:
        if z["f"].shape[0] != len(a.prompt) + len(a.answer):  # another answer's features under this job's number: made again
            return False
        top = (z["top_id"], z["top_lp"]) if "top_id" in z.files else None
        if relabel and a.top_id.shape[1] < relabel and (top is None or top[0].shape[1] < relabel):
            return False  # cached without the labels asked for: its forward again
        feats[a.job] = z["f"]
        if top is not None:
            labels[a.job] = top
    return True


def _relabel(data, labels: dict, relabel: int) -> int:
    """Give the answers in ``data``'s shards that have ``labels`` their top-``relabel``, each shard
    written again where one changed; returns how many answers were."""
    from specdec.shards import read_shard, shard_paths, write_shard

    relabeled = 0
    for path in shard_paths(data):
        shard = list(read_shard(path))
        if all(a.top_id.shape[1] >= relabel or a.job not in labels for a in shard):
            continue
        for a in shard:
            if a.job in labels:
                a.top_id, a.top_lp = (x[:, :relabel] for x in labels[a.job])
                relabeled += 1
        write_shard(data, int(path.stem.split("-")[1]), shard)
    return relabeled

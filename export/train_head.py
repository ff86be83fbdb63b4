"""``specdec train-drafter``: train a feature head (export/head.py) for a bundle's target and write it into the bundle.

    data      windows of ``window`` tokens from the corpus, in the bundle's tokenizer; the
              target's features f [N, T, d] for them from the bundle's own target graph (ONNX
              Runtime: exactly the model the runtime serves), float16 in memory
    train     row j reads (token_j, c_j = f_{j-1} + noise); its output h_j is pulled to f_j
              (smooth L1) and its distribution softmax(h_j H) to the target's softmax(f_j H)
              (cross-entropy to the target's soft labels: distillation); AdamW, cosine schedule
    unroll    with ``unroll`` > 1 (EAGLE-3's training-time test), pass k reads the head's own
              pass-(k-1) outputs as contexts, as drafting step k does, and adds its loss
    write     the head graph into a staged copy of the bundle (export/feature.py), checked
              against PyTorch, re-hashed; the bundle is replaced only when all of it passed

Held-out figures (teacher-forced, one step from true features): α = E[Σ min(p, q)] at T=1
and argmax agreement at T=0, on windows of files never trained on.
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

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".c", ".h", ".js", ".ts", ".go", ".rs", ".java")


@dataclass(frozen=True)
class Recipe:
    steps: int = 600
    batch: int = 8
    window: int = 256
    windows: int = 1200  # training windows whose target features are computed once
    lr: float = 2e-3
    noise: float = 0.1  # uniform noise on the context features, relative to their RMS (EAGLE's robustness to its own errors)
    kl_weight: float = 1.0  # weight of the distribution loss against the feature loss (1)
    unroll: int = 1
    intermediate: int | None = None  # the head's MLP width [default: 8/3 d, rounded to 64]
    draft_vocab: int | None = None  # draft over the N most frequent training tokens only (None: the whole vocabulary)
    seed: int = 0


def corpus_files(corpus: str) -> tuple[list[Path], list[Path]]:
    """(training, held-out) files: "stdlib" is the demo pair's split; a folder gives its text files,
    every 20th (by sorted path) held out."""
    if corpus == "stdlib":
        from specdec.bench.corpus import stdlib_files

        return stdlib_files(held_out=False), stdlib_files(held_out=True)
    root = Path(corpus)
    files = sorted(f for f in root.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES) if root.is_dir() else []
    if len(files) < 2:
        raise ConfigError(f"--corpus {corpus}: expected 'stdlib' or a folder with at least 2 text files ({', '.join(TEXT_SUFFIXES)})")
    return [f for i, f in enumerate(files) if i % 20 != 19], [f for i, f in enumerate(files) if i % 20 == 19] or files[-1:]


def windows_of(files: list[Path], encode: Callable[[str], list[int]], window: int, count: int, rng: np.random.Generator,
               sep: int | None) -> np.ndarray:  # fmt: skip
    """``count`` windows [count, window] int64 at random offsets of the files' concatenated tokens."""
    ids: list[int] = []
    for f in files:
        ids += encode(f.read_text(encoding="utf-8", errors="replace")) + ([sep] if sep is not None else [])
    stream = np.asarray(ids, dtype=np.int64)
    if len(stream) <= window:
        raise ConfigError(f"the corpus has {len(stream)} tokens; a training window takes {window + 1}")
    starts = rng.integers(0, len(stream) - window, count)
    return np.stack([stream[s : s + window] for s in starts])


def target_features(bundle: Path, manifest, windows: np.ndarray, report: Callable[[str], None]) -> np.ndarray:
    """The target's features [N, T, d] float16 for each window (fed from an empty cache)."""
    from specdec.engines.kv import KVCache
    from specdec.engines.ort import runner_for

    name, g = manifest.graph("target", "dynamic")
    t = manifest.target
    cache = KVCache(t.num_layers, t.num_kv_heads, manifest.max_seq_len, t.head_dim, manifest.dtype)
    runner = runner_for(bundle, name, g, cache)
    out = np.zeros((*windows.shape, runner.features.shape[-1]), dtype=np.float16)
    t0 = time.perf_counter()
    for i, w in enumerate(windows):
        cache.rewind_to(0)
        runner.run(w)
        out[i] = runner.features[0, : len(w)]
        if (i + 1) % 200 == 0:
            report(f"target features {i + 1}/{len(windows)} ({time.perf_counter() - t0:.0f} s)")
    return out


def contexts(f: torch.Tensor) -> torch.Tensor:
    """c_j = f_{j-1}, c_0 = 0: [B, T, d]."""
    return torch.cat([torch.zeros_like(f[:, :1]), f[:, :-1]], dim=1)


def losses(head, ids: torch.Tensor, f: torch.Tensor, recipe: Recipe, noise: bool) -> tuple[torch.Tensor, dict]:
    """The training loss over a batch (ids [B, T], target features f [B, T, d] float32) and its parts."""
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    with torch.no_grad():
        p = torch.softmax(f @ head.full_head_t, dim=-1)[..., head.vocab_ids]  # [B, T, N]: the target's mass on the draft vocabulary
    ctx = contexts(f)
    if noise and recipe.noise:
        scale = recipe.noise * f.pow(2).mean().sqrt()
        ctx = ctx + (torch.rand_like(ctx) * 2 - 1) * scale
    total, parts = 0.0, {}
    for k in range(recipe.unroll):
        logits, h = head.draft_logits(ids, pos, ctx)
        reg = torch.nn.functional.smooth_l1_loss(h, f)
        ce = -(p * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
        total = total + reg + recipe.kl_weight * ce
        parts[f"reg{k}"], parts[f"ce{k}"] = round(reg.item(), 4), round(ce.item(), 4)
        ctx = contexts(h)  # the next pass reads the head's own features, as drafting step k + 1 does
    return total, parts


def evaluate(head, ids: np.ndarray, f: np.ndarray) -> dict[str, float]:
    """Teacher-forced one-step figures on held-out windows: α at T=1 and argmax agreement at T=0."""
    with torch.no_grad():
        t, ft = torch.from_numpy(ids), torch.from_numpy(f.astype(np.float32))
        logits, _ = head(t, torch.arange(t.shape[1])[None].expand_as(t), contexts(ft))
        p = torch.softmax(ft @ head.full_head_t, -1)
        q = torch.softmax(logits, -1)
        alpha = torch.minimum(p, q).sum(-1).mean()
        agree = (p.argmax(-1) == q.argmax(-1)).float().mean()
    return {"alpha_t1": round(float(alpha), 4), "argmax_t0": round(float(agree), 4)}


def train(bundle: Path, corpus: str, recipe: Recipe, save: Path | None = None, report: Callable[[str], None] = print) -> dict:
    """Train a head for ``bundle``'s target on ``corpus`` and write it into the bundle; returns the training record."""
    from specdec.export.bundle import commit
    from specdec.export.feature import add_head, expose_features, restaged, tables
    from specdec.export.head import FeatureHead, HeadConfig, save_head
    from specdec.manifest import load_manifest
    from specdec.runtime.text import TextCodec

    bundle = Path(bundle)
    manifest = load_manifest(bundle)
    if manifest.seq2seq:
        raise ConfigError(f"{bundle} is an encoder-decoder bundle; the feature drafter is for decoder-only targets")
    if manifest.dtype != "float32" or manifest.target.quantization:
        raise ConfigError(f"{bundle} is a {manifest.target.quantization or manifest.dtype} bundle; the feature head reads the target's float32 "
                          "embedding and LM head: train it on a float32 export without --quantize")  # fmt: skip
    codec = TextCodec.from_bundle(bundle, manifest)
    if codec is None:
        raise ConfigError(f"{bundle} has no tokenizer; the training corpus is text: re-export the bundle with its tokenizer")
    torch.manual_seed(recipe.seed)
    rng = np.random.default_rng(recipe.seed)
    train_files, held_files = corpus_files(corpus)
    sep = manifest.eos_token_ids[0] if manifest.eos_token_ids else None
    window = min(recipe.window, manifest.max_seq_len)
    t_start = time.perf_counter()
    with restaged(bundle) as stage:
        staged = expose_features(stage, manifest)
        embed, head_t, tied = tables(stage, staged)
        d = embed.shape[1]
        ids = windows_of(train_files, lambda s: codec.encode(s, special=False), window, recipe.windows, rng, sep)
        held = windows_of(held_files, lambda s: codec.encode(s, special=False), window, 32, np.random.default_rng(recipe.seed + 1), sep)
        report(f"{len(train_files)} training files, {len(held_files)} held out; {recipe.windows} windows of {window} tokens")
        feats, held_feats = target_features(stage, staged, ids, report), target_features(stage, staged, held, report)
        t_data = time.perf_counter() - t_start
        t = staged.target
        inter = recipe.intermediate or int(round(8 * d / 3 / 64)) * 64
        vocab_ids = None
        if recipe.draft_vocab is not None:
            if not 1 <= recipe.draft_vocab <= staged.vocab_size:
                raise ConfigError(f"--draft-vocab {recipe.draft_vocab}: expected 1..{staged.vocab_size} (the target's vocabulary)")
            counts = np.bincount(ids.ravel(), minlength=staged.vocab_size)
            vocab_ids = torch.from_numpy(np.sort(np.argsort(-counts, kind="stable")[: recipe.draft_vocab]))
        cfg = HeadConfig(d, inter, t.num_heads, t.num_kv_heads, t.head_dim, staged.vocab_size, staged.max_seq_len, draft_vocab=recipe.draft_vocab)
        head = FeatureHead(cfg, torch.from_numpy(embed), torch.from_numpy(head_t), vocab_ids, tied)
        params = [p for p in head.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0, betas=(0.9, 0.95))
        before = evaluate(head.eval(), held, held_feats)
        log = []
        t0 = time.perf_counter()
        head.train()
        for step in range(recipe.steps):
            lr = recipe.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / recipe.steps))
            for group in opt.param_groups:
                group["lr"] = lr
            pick = rng.integers(0, len(ids), recipe.batch)
            loss, parts = losses(head, torch.from_numpy(ids[pick]), torch.from_numpy(feats[pick].astype(np.float32)), recipe, noise=True)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            if (step + 1) % 50 == 0 or step + 1 == recipe.steps:
                log.append([step + 1, round(loss.item(), 4)])
                report(f"step {step + 1}/{recipe.steps} loss {loss.item():.4f} {parts} ({time.perf_counter() - t0:.0f} s)")
        head.eval()
        record = {
            "recipe": asdict(recipe), "corpus": corpus, "train_files": len(train_files), "held_out_files": len(held_files),
            "data_seconds": round(t_data, 1), "train_seconds": round(time.perf_counter() - t0, 1), "log": log,
            "held_out": {"before": before, "after": evaluate(head, held, held_feats)},
        }  # fmt: skip
        report(f"held-out α(T=1) / argmax agreement: {record['held_out']['after']}")
        final = add_head(stage, staged, head, record)
        if save is not None:
            save_head(head, Path(save), record)
        commit(stage, bundle, final)
    return record

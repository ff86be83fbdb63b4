"""Train specdec's demo pair on this machine's CPython standard library, offline and seeded.

Corpus: the stdlib's own ``.py`` files (``sysconfig.get_paths()["stdlib"]``, without
``site-packages`` and test packages), split by file: a file whose path hashes to 0 mod 20 is
held out for validation. Tokenizer: byte-level BPE (``tokenizers``), 4096 ids, trained on the
training files only. Models: Llama-architecture target (~12.6M parameters) and draft (~1M);
the target is trained on next-token cross-entropy, then the draft is distilled from it
(paper §6: KL to the target's soft outputs, plus cross-entropy).

    python tools/train_demo_pair.py [--target-steps 1200] [--draft-steps 700] [--out models/demo]

A new draft for an existing target (the target and its tokenizer are loaded, not trained;
``--draft-init`` continues from an existing draft instead of a fresh one; ``--draft-size``
sets hidden size, layers and MLP width of a fresh one):

    python tools/train_demo_pair.py --teacher models/demo/target --draft-init models/demo/draft \
        --draft-steps 600 --draft-lr 1.5e-3 --out .bench/drafts/cont

Budgets are in steps (on this 2-core CPU: ~3.8 s per target step, ~1.6 s per draft step with
its teacher), so a run is deterministic. Resumable: state is checkpointed under .bench/demo/
every few minutes and a rerun continues where it stopped. At the end it writes float16
safetensors checkpoints, the tokenizer and a model card (data, steps, validation loss, α at
T=0 and T=1 on held-out files) to --out/target and --out/draft.
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".bench" / "demo"
VOCAB = 4096
SEQ = 256
SEED = 0
EOT = "<|endoftext|>"
TARGET = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=7, num_attention_heads=6,
              num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=10000.0)
DRAFT = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=10000.0)


def code_ids(tok) -> np.ndarray:
    """Third-party code (specdec bench --corpus code's packages), outside the training corpus:
    what the demo pair's acceptance is judged on."""
    from specdec.bench.corpus import CODE_PACKAGES, package_files

    eot = tok.convert_tokens_to_ids(EOT)
    ids = []
    for pkg in CODE_PACKAGES:
        for f in package_files(pkg):
            ids += tok(read(f), add_special_tokens=False)["input_ids"] + [eot]
    return np.asarray(ids, dtype=np.uint16)


def corpus_files() -> tuple[list[Path], list[Path]]:
    """(train, held-out) stdlib source files, in a fixed order: the split ``specdec bench`` uses."""
    from specdec.bench.corpus import stdlib_files

    return stdlib_files(held_out=False), stdlib_files(held_out=True)


def read(f: Path) -> str:
    return f.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: list[Path], folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if (folder / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(folder)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOT, "<|pad|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((read(f) for f in files), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token="<|pad|>")
    fast.save_pretrained(folder)
    return fast


def encode(tok, files: list[Path], path: Path) -> np.ndarray:
    """All files' ids, each followed by end-of-text, as one uint16 array (cached)."""
    if path.is_file():
        return np.load(path)
    eot = tok.convert_tokens_to_ids(EOT)
    ids = []
    for f in files:
        ids += tok(read(f), add_special_tokens=False)["input_ids"] + [eot]
    arr = np.asarray(ids, dtype=np.uint16)
    np.save(path, arr)
    return arr


def make_model(spec: dict, tok):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    eot = tok.convert_tokens_to_ids(EOT)
    cfg = LlamaConfig(**spec, vocab_size=VOCAB, bos_token_id=eot, eos_token_id=eot, pad_token_id=tok.pad_token_id)
    return LlamaForCausalLM(cfg)


def batches(data: np.ndarray, batch: int, step: int, data_seed: int = SEED):
    """The batch of ``step``: a deterministic function of (seed, step), so resuming is exact."""
    import torch

    rng = np.random.default_rng([data_seed, step])
    starts = rng.integers(0, len(data) - SEQ - 1, size=batch)
    x = np.stack([data[s : s + SEQ + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(x[:, :-1]), torch.from_numpy(x[:, 1:])


def lr_at(step: int, total: int, peak: float, warmup: int = 200) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def resume(ckpt: Path, model, opt, name: str) -> dict:
    """The training state saved at ``ckpt`` (model and optimizer restored from it), or a fresh one."""
    import torch

    if not ckpt.is_file():
        return dict(step=0, seconds=0.0, log=[])
    saved = torch.load(ckpt, weights_only=False)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    print(f"{name}: resumed at step {saved['state']['step']} ({saved['state']['seconds'] / 60:.1f} min)", flush=True)
    return saved["state"]


def optimizer_step(model, opt, loss, state: dict, t0: float) -> None:
    """One AdamW step on ``loss`` (gradients clipped to norm 1), counted in ``state`` with its time since ``t0``."""
    import torch

    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    state["step"] += 1
    state["seconds"] += time.time() - t0


def train(name: str, model, data: np.ndarray, steps: int, batch: int, peak_lr: float, teacher=None, data_seed: int = SEED):
    """Train for ``steps`` optimizer steps (resuming from the last checkpoint)."""
    import torch
    import torch.nn.functional as F

    ckpt = WORK / f"{name}.pt"
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    state = resume(ckpt, model, opt, name)
    if state["step"] >= steps:
        return state
    model.train()
    last_save = time.time()
    while state["step"] < steps:
        t0 = time.time()
        step = state["step"]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, peak_lr)
        x, y = batches(data, batch, step, data_seed)
        logits = model(x).logits
        ce = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        loss = ce
        if teacher is not None:
            with torch.no_grad():
                soft = teacher(x).logits.log_softmax(-1)
            kl = F.kl_div(logits.log_softmax(-1), soft, log_target=True, reduction="batchmean") / SEQ
            loss = 0.8 * kl + 0.2 * ce
        optimizer_step(model, opt, loss, state, t0)
        if state["step"] % 50 == 0:
            state["log"].append((state["step"], round(float(ce), 4)))
            print(f"{name} step {state['step']}/{steps} ce {float(ce):.3f} loss {float(loss):.3f} "
                  f"{state['seconds'] / 60:.1f} min", flush=True)
        if time.time() - last_save > 180:
            torch.save(dict(model=model.state_dict(), opt=opt.state_dict(), state=state), ckpt)
            last_save = time.time()
    torch.save(dict(model=model.state_dict(), opt=opt.state_dict(), state=state), ckpt)
    return state


def evaluate(target, draft, data: np.ndarray, windows: int = 64) -> dict:
    """Held-out cross-entropy of both models and α = E[Σ min(p, q)] at T=1 and at T=0
    (argmax agreement), teacher-forced over fixed windows of the held-out files."""
    import torch

    rng = np.random.default_rng(1234)
    starts = rng.integers(0, len(data) - SEQ - 1, size=windows)
    x = torch.from_numpy(np.stack([data[s : s + SEQ + 1] for s in starts]).astype(np.int64))
    out = dict(target_ce=0.0, draft_ce=0.0, alpha_t1=0.0, alpha_t0=0.0)
    target.eval()
    draft.eval()
    with torch.no_grad():
        for i in range(0, windows, 8):
            xb, yb = x[i : i + 8, :-1], x[i : i + 8, 1:]
            lp, lq = target(xb).logits.float(), draft(xb).logits.float()
            out["target_ce"] += float(torch.nn.functional.cross_entropy(lp.reshape(-1, VOCAB), yb.reshape(-1))) / (windows / 8)
            out["draft_ce"] += float(torch.nn.functional.cross_entropy(lq.reshape(-1, VOCAB), yb.reshape(-1))) / (windows / 8)
            p, q = lp.softmax(-1), lq.softmax(-1)
            out["alpha_t1"] += float(torch.minimum(p, q).sum(-1).mean()) / (windows / 8)
            out["alpha_t0"] += float((lp.argmax(-1) == lq.argmax(-1)).float().mean()) / (windows / 8)
    return {k: round(v, 4) for k, v in out.items()}


def save(model, tok, folder: Path) -> None:
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(folder, safe_serialization=True)
    model.to(torch.float32)
    tok.save_pretrained(folder)


def card(args, files, held, ntrain, nheld, states, figures, tparams, dparams) -> str:
    return f"""# specdec demo pair

A Llama-architecture target ({tparams / 1e6:.1f}M parameters) and draft ({dparams / 1e6:.2f}M), trained from
scratch on this machine by `python tools/train_demo_pair.py --target-steps {args.target_steps} --draft-steps {args.draft_steps}`
(seed {SEED}; CPU, {args.threads} threads; {(states['target']['seconds'] + states['draft']['seconds']) / 60:.0f} min of training). They exist to demonstrate and benchmark specdec, not to write good code.

- **Data**: the CPython {sysconfig.get_python_version()} standard library's own `.py` files, without
  `site-packages` and test packages: {len(files)} training files ({ntrain:,} tokens), {len(held)} held-out files
  ({nheld:,} tokens; a file is held out when the sha256 of its relative path is 0 mod 20).
- **Tokenizer**: byte-level BPE, {VOCAB} ids, trained on the training files; `{EOT}` is bos and eos.
- **Training**: sequences of {SEQ} tokens, AdamW, cosine schedule. Target: {states['target']['step']} steps of
  next-token cross-entropy. Draft: {states['draft']['step']} steps distilled from the target
  (0.8 × KL to the target's softmax + 0.2 × cross-entropy; paper §6).
- **Held-out** (teacher-forced, 64 windows of {SEQ} tokens): target cross-entropy {figures['target_ce']:.3f},
  draft {figures['draft_ce']:.3f} nats/token; α = E[Σ min(p, q)] = **{figures['alpha_t1']:.3f} at T=1**,
  argmax agreement **{figures['alpha_t0']:.3f} at T=0**.
- **Format**: float16 safetensors, `config.json`, tokenizer files.
"""


def main() -> None:
    global WORK
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target-steps", type=int, default=1200)
    ap.add_argument("--draft-steps", type=int, default=700)
    ap.add_argument("--out", type=Path, default=ROOT / "models" / "demo")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--teacher", type=Path, default=None, help="an existing target checkpoint (and its tokenizer): train only a draft")
    ap.add_argument("--draft-init", type=Path, default=None, help="continue distilling this draft checkpoint")
    ap.add_argument("--draft-size", default=None, help="hidden,layers,intermediate of a fresh draft [default: 128,2,384]")
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--data-seed", type=int, default=SEED, help="which training windows the draft sees (a continuation: another seed)")
    ap.add_argument("--work", type=Path, default=WORK, help="checkpoints and token caches")
    args = ap.parse_args()

    import torch

    WORK = args.work
    torch.set_num_threads(args.threads)
    WORK.mkdir(parents=True, exist_ok=True)
    files, held = corpus_files()
    if args.teacher is not None:
        from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast.from_pretrained(args.teacher)
        target = LlamaForCausalLM.from_pretrained(args.teacher, dtype=torch.float32)
    else:
        tok = train_tokenizer(files, WORK / "tokenizer")
        target = make_model(TARGET, tok)
    train_ids, held_ids = encode(tok, files, WORK / "train.npy"), encode(tok, held, WORK / "held.npy")
    print(f"{len(files)} train files ({len(train_ids):,} tokens), {len(held)} held out ({len(held_ids):,})", flush=True)

    spec = dict(DRAFT)
    if args.draft_size:
        hidden, layers, inter = (int(v) for v in args.draft_size.split(","))
        spec.update(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter)
    if args.draft_init is not None:
        from transformers import LlamaForCausalLM

        draft = LlamaForCausalLM.from_pretrained(args.draft_init, dtype=torch.float32)
    else:
        draft = make_model(spec, tok)
    states = {"target": train("target", target, train_ids, args.target_steps, batch=16, peak_lr=2e-3)} if args.teacher is None else {}
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    states["draft"] = train("draft", draft, train_ids, args.draft_steps, batch=16, peak_lr=args.draft_lr, teacher=target, data_seed=args.data_seed)
    figures = evaluate(target, draft, held_ids)
    code = evaluate(target, draft, code_ids(tok))
    figures.update({f"code_{k}": v for k, v in code.items()})
    print(json.dumps(figures), flush=True)
    if args.teacher is not None:  # a draft alone: no card for the pair
        save(draft, tok, args.out / "draft")
        (args.out / "draft_training.json").write_text(json.dumps(dict(args={k: str(v) for k, v in vars(args).items()}, figures=figures,
                                                                      state={k: states["draft"][k] for k in ("step", "seconds", "log")}), indent=1))  # fmt: skip
        return
    tparams, dparams = sum(p.numel() for p in target.parameters()), sum(p.numel() for p in draft.parameters())
    save(target, tok, args.out / "target")
    save(draft, tok, args.out / "draft")
    (args.out / "README.md").write_text(card(args, files, held, len(train_ids), len(held_ids), states, figures, tparams, dparams))
    (args.out / "training.json").write_text(json.dumps(dict(figures=figures, states={k: {kk: v[kk] for kk in ("step", "seconds", "log")} for k, v in states.items()}), indent=1))


if __name__ == "__main__":
    main()

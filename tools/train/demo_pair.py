"""Train specdec's demo pair (models/demo) on this machine's CPython standard library, offline and seeded.

A byte-level BPE tokenizer (4096 ids), a Llama target (~12.6M parameters) and a draft (~1M) distilled
from it, trained on the stdlib's ``.py`` files as ``specdec bench`` splits them:

    python tools/train/demo_pair.py [--target-steps 1200] [--draft-steps 700] [--out models/demo]

A new draft for an existing target (``--draft-init`` continues a draft, ``--draft-size`` shapes a fresh one):

    python tools/train/demo_pair.py --teacher models/demo/target --draft-init models/demo/draft \
        --draft-steps 600 --draft-lr 1.5e-3 --out .bench/drafts/cont

Budgets are in steps (2-core CPU: ~3.8 s a target step, ~1.6 s a draft step): a run is deterministic and
resumable from --work. --out gets float16 safetensors, the tokenizer and a model card.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import torch
from common import ROOT, agreement, corpus_files, freeze, losses, pair_args, read, save, train

from specdec.commands.bench.corpus import CODE_PACKAGES, package_files

VOCAB = 4096
SEQ = 256
BATCH = 16
SEED = 0
EOT = "<|endoftext|>"
TARGET = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=7, num_attention_heads=6,
              num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=10000.0)
DRAFT = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=10000.0)


def token_ids(tok, files: list[Path], cache: Path | None = None) -> np.ndarray:
    """All files' ids, each followed by end-of-text: [n] uint16 (kept at ``cache`` when given)."""
    if cache is not None and cache.is_file():
        return np.load(cache)
    eot, ids = tok.convert_tokens_to_ids(EOT), []
    for f in files:
        ids += tok(read(f), add_special_tokens=False)["input_ids"] + [eot]
    arr = np.asarray(ids, dtype=np.uint16)
    if cache is not None:
        np.save(cache, arr)
    return arr


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


def make_model(spec: dict, tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    eot = tok.convert_tokens_to_ids(EOT)
    return LlamaForCausalLM(LlamaConfig(**spec, vocab_size=VOCAB, bos_token_id=eot, eos_token_id=eot, pad_token_id=tok.pad_token_id))


def windows(data: np.ndarray, count: int, seed):
    """``count`` random windows of ``data``, a function of ``seed``: inputs and next tokens, [count, SEQ] each."""
    starts = np.random.default_rng(seed).integers(0, len(data) - SEQ - 1, size=count)
    x = torch.from_numpy(np.stack([data[s : s + SEQ + 1] for s in starts]).astype(np.int64))
    return x[:, :-1], x[:, 1:]


def fit(name: str, model, data: np.ndarray, steps: int, peak_lr: float, work: Path, teacher=None, data_seed: int = SEED) -> dict:
    """``steps`` steps on batches that are a function of (data_seed, step), so resuming is exact."""
    def step_loss(step):
        x, y = windows(data, BATCH, [data_seed, step])
        logits = model(x).logits.reshape(-1, VOCAB)  # [BATCH * SEQ, VOCAB]
        with torch.no_grad():
            soft = None if teacher is None else teacher(x).logits.reshape(-1, VOCAB).log_softmax(-1)
        return losses(logits, y.reshape(-1), soft)

    return train(name, model, steps, peak_lr, step_loss, work)


def evaluate(target, draft, data: np.ndarray, count: int = 64) -> dict:
    """Held-out cross-entropy of both models and α at T=1 and T=0, teacher-forced over fixed windows."""
    x, y = windows(data, count, 1234)
    batches = ((x[i : i + 8], y[i : i + 8].reshape(-1)) for i in range(0, count, 8))
    figures = agreement(target, draft, batches, lambda m, xb: m(xb).logits.reshape(-1, VOCAB))
    return {k: v for k, v in figures.items() if k != "positions"}


def card(args, files, held, ntrain, nheld, states, figures, tparams, dparams) -> str:
    return f"""# specdec demo pair

A Llama-architecture target ({tparams / 1e6:.1f}M parameters) and draft ({dparams / 1e6:.2f}M), trained from
scratch on this machine by `python tools/train/demo_pair.py --target-steps {args.target_steps} --draft-steps {args.draft_steps}`
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
    args = pair_args(__doc__, ROOT / "models" / "demo", ROOT / ".bench" / "demo", "token caches", (1200, 700), 3e-3, 2,
                     ("--teacher", Path, None, "an existing target checkpoint (and its tokenizer): train only a draft"),
                     ("--draft-init", Path, None, "continue distilling this draft checkpoint"),
                     ("--draft-size", str, None, "hidden,layers,intermediate of a fresh draft [default: 128,2,384]"),
                     ("--data-seed", int, SEED, "which training windows the draft sees (a continuation: another seed)"))

    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    files, held = corpus_files()
    if args.teacher is not None:
        tok = PreTrainedTokenizerFast.from_pretrained(args.teacher)
        target = LlamaForCausalLM.from_pretrained(args.teacher, dtype=torch.float32)
    else:
        tok = train_tokenizer(files, args.work / "tokenizer")
        target = make_model(TARGET, tok)
    train_ids, held_ids = token_ids(tok, files, args.work / "train.npy"), token_ids(tok, held, args.work / "held.npy")
    print(f"{len(files)} train files ({len(train_ids):,} tokens), {len(held)} held out ({len(held_ids):,})", flush=True)

    if args.draft_init is not None:
        draft = LlamaForCausalLM.from_pretrained(args.draft_init, dtype=torch.float32)
    else:
        hidden, layers, inter = (int(v) for v in (args.draft_size or "128,2,384").split(","))
        draft = make_model({**DRAFT, "hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": inter}, tok)
    states = {} if args.teacher is not None else {"target": fit("target", target, train_ids, args.target_steps, 2e-3, args.work)}
    states["draft"] = fit("draft", draft, train_ids, args.draft_steps, args.draft_lr, args.work, freeze(target), args.data_seed)
    figures = evaluate(target, draft, held_ids)
    code = token_ids(tok, [f for pkg in CODE_PACKAGES for f in package_files(pkg)])  # third-party code, never trained on
    figures.update({f"code_{k}": v for k, v in evaluate(target, draft, code).items()})
    print(json.dumps(figures), flush=True)
    logged = {k: {kk: v[kk] for kk in ("step", "seconds", "log")} for k, v in states.items()}
    save(draft, tok, args.out / "draft")
    if args.teacher is not None:  # a draft alone: no card for the pair
        record = dict(args={k: str(v) for k, v in vars(args).items()}, figures=figures, state=logged["draft"])
        (args.out / "draft_training.json").write_text(json.dumps(record, indent=1))
        return
    save(target, tok, args.out / "target")
    tparams, dparams = (sum(p.numel() for p in m.parameters()) for m in (target, draft))
    (args.out / "README.md").write_text(card(args, files, held, len(train_ids), len(held_ids), states, figures, tparams, dparams))
    (args.out / "training.json").write_text(json.dumps(dict(figures=figures, states=logged), indent=1))


if __name__ == "__main__":
    main()

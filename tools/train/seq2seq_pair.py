"""Train specdec's seq2seq demo pair (models/demo/seq2seq: T5 target + T5 draft) on this machine's CPython standard library, offline and seeded.

Task: a stdlib function (16-160 tokens) -> the same text with its parameters renamed ``a0, a1, ...``
and its other locals ``v0, v1, ...``, all else unchanged (``normalize``). Tokenizer: the demo pair's
(``<|endoftext|>`` 0 is eos, ``<|pad|>`` 1 pad and decoder start). Target: T5, d_model 256, 4+4
layers (~8.4M); draft: d_model 128, 2+1 layers (~1.2M), distilled from it.

    python tools/train/seq2seq_pair.py [--target-steps 1100] [--draft-steps 800] [--out models/demo/seq2seq] \
        [--threads 1] [--work .bench/seq2seq]

The defaults are models/demo/seq2seq's recipe (2-core CPU, 1 thread: 35 + 14 min); a run is
deterministic and resumable from --work. --out gets float16 checkpoints and the tokenizer in target/
and draft/, a model card and training.json. ``pairs_from_files`` and ``normalize`` can be imported.
"""

from __future__ import annotations

import ast
import io
import json
import keyword
import re
import sys
import textwrap
import time
import tokenize
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from common import ROOT, agreement, corpus_files, freeze, losses, pair_args, read, save, train

TOKENIZER = ROOT / "models" / "demo" / "target"
VOCAB = 4096
EOS, PAD = 0, 1
MIN_TOKENS, MAX_TOKENS = 16, 160
SEED = 0
BATCH = 32
WARMUP = 100
COMMON = dict(vocab_size=VOCAB, d_kv=32, feed_forward_proj="relu", tie_word_embeddings=True, relative_attention_num_buckets=32,
              relative_attention_max_distance=128, dropout_rate=0.0, eos_token_id=EOS, pad_token_id=PAD,
              decoder_start_token_id=PAD, bos_token_id=None)  # fmt: skip
TARGET = dict(d_model=256, num_heads=8, d_ff=1024, num_layers=4, num_decoder_layers=4)
DRAFT = dict(d_model=128, num_heads=4, d_ff=512, num_layers=2, num_decoder_layers=1)
_GENERATED = re.compile(r"[av]\d+\Z")
_SKIP = {tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT}


def _local_names(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[list[str], set[str]] | None:
    """(parameters in signature order, other locally assigned names) of ``fn``, not looking into
    nested functions, lambdas or classes; None when the function is not safe to rename (a nested
    class, or a local name that is also imported or the name of a nested def)."""
    a = fn.args
    params = [x.arg for x in (*a.posonlyargs, *a.args, *([a.vararg] if a.vararg else []), *a.kwonlyargs, *([a.kwarg] if a.kwarg else []))]
    stored: set[str] = set()
    outer: set[str] = set()  # declared global or nonlocal: not local
    fixed: set[str] = set()  # imported or defined by a nested def: keep their spelling

    def visit(node: ast.AST) -> bool:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                return False
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                fixed.add(child.name)  # its body is another scope; its name is a local binding we keep
                for d in (*child.decorator_list, *child.args.defaults, *child.args.kw_defaults):
                    if d is not None and not visit(ast.Expression(d)):
                        return False
                continue
            if isinstance(child, ast.Lambda):
                continue
            if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                stored.add(child.id)
            elif isinstance(child, ast.ExceptHandler) and child.name:
                stored.add(child.name)
            elif isinstance(child, (ast.Global, ast.Nonlocal)):
                outer.update(child.names)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                fixed.update((al.asname or al.name).split(".")[0] for al in child.names)
            if not visit(child):
                return False
        return True

    for stmt in fn.body:
        if not visit(ast.Module(body=[stmt], type_ignores=[])):
            return None
    stored -= outer
    if fixed & (stored | set(params)):
        return None
    return params, stored - set(params)


def normalize(source: str) -> str | None:
    """``source`` (one dedented function definition) with its local names normalized, or None when
    it has nothing to rename or cannot be renamed safely."""
    try:
        tree = ast.parse(source)
        toks = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (SyntaxError, tokenize.TokenError, IndentationError, ValueError):
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) or (names := _local_names(tree.body[0])) is None:
        return None
    params, others = names
    local = set(params) | others
    if not local or any(_GENERATED.match(t.string) for t in toks if t.type == tokenize.NAME):
        return None  # nothing to rename, or a new name could collide with an existing one
    if any(isinstance(n, ast.Name) and n.id in local for j in ast.walk(tree) if isinstance(j, ast.JoinedStr) for n in ast.walk(j)):
        return None  # an f-string is one token before Python 3.12: its names could not be renamed
    rows = source.splitlines(keepends=True)

    def at(node: ast.AST) -> tuple[int, int]:  # ast columns count UTF-8 bytes, tokenize's characters
        return node.lineno, len(rows[node.lineno - 1].encode()[: node.col_offset].decode(errors="replace"))

    fn = tree.body[0]
    kwargs = {at(k) for k in ast.walk(tree) if isinstance(k, ast.keyword) and k.arg is not None}
    # In the header only the parameters themselves are renamed: defaults and annotations are
    # evaluated outside the function (``def f(len=len)``).
    first = fn.body[0]
    header_end = at(first.decorator_list[0] if getattr(first, "decorator_list", None) else first)
    a = fn.args
    arg_at = {at(x) for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x is not None}
    # Parameters are numbered in signature order, other locals in order of first occurrence.
    mapping = {p: f"a{i}" for i, p in enumerate(params)}
    renames: list[tuple[int, int, int, str]] = []  # (row, start col, end col, new name)
    prev = None
    for t in toks:
        if t.type == tokenize.NAME and t.string in local and not keyword.iskeyword(t.string):
            attribute = prev is not None and prev.type == tokenize.OP and prev.string == "."
            if not attribute and t.start not in kwargs and (t.start >= header_end or t.start in arg_at):
                if t.string not in mapping:
                    mapping[t.string] = f"v{sum(1 for v in mapping.values() if v[0] == 'v')}"
                renames.append((t.start[0], t.start[1], t.end[1], mapping[t.string]))
        if t.type not in _SKIP:
            prev = t
    for row, c0, c1, new in sorted(renames, reverse=True):  # right to left: earlier columns stay valid
        line = rows[row - 1]
        rows[row - 1] = line[:c0] + new + line[c1:]
    out = "".join(rows)
    try:
        ast.parse(out)
    except SyntaxError:
        return None
    return out


def functions(text: str) -> list[str]:
    """The dedented source of every top-level function and method in ``text``."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    nodes = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        nodes += [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    segments = (ast.get_source_segment(text, n, padded=True) for n in nodes)
    return [textwrap.dedent(s) for s in segments if s]


def load_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


def pairs_from_files(files, tok=None, seed: int = SEED) -> list[tuple[str, str]]:
    """(source, normalized) pairs of the functions in ``files`` whose source is 16-160 demo
    tokens long and has local names, deduplicated, in a seeded shuffled order."""
    tok = tok or load_tokenizer()
    seen, pairs = set(), []
    for src in (s for f in files for s in functions(read(f))):
        if src in seen:
            continue
        seen.add(src)
        if MIN_TOKENS <= len(tok(src, add_special_tokens=False)["input_ids"]) <= MAX_TOKENS:
            tgt = normalize(src)
            if tgt is not None and tgt != src:
                pairs.append((src, tgt))
    return [pairs[i] for i in np.random.default_rng(seed).permutation(len(pairs))]


def encode_pairs(tok, pairs: list[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
    src = tok([s for s, _ in pairs], add_special_tokens=False)["input_ids"]
    tgt = tok([t for _, t in pairs], add_special_tokens=False)["input_ids"]
    return [(s + [EOS], t + [EOS]) for s, t in zip(src, tgt)]


def collate(items: list[tuple[list[int], list[int]]]):
    """Padded input_ids [B, S], attention_mask [B, S] and labels [B, T] (padded with -100)."""
    ns, nt = max(len(s) for s, _ in items), max(len(t) for _, t in items)
    x = torch.full((len(items), ns), PAD, dtype=torch.long)
    y = torch.full((len(items), nt), -100, dtype=torch.long)
    for i, (s, t) in enumerate(items):
        x[i, : len(s)] = torch.tensor(s)
        y[i, : len(t)] = torch.tensor(t)
    return x, (x != PAD).long(), y


def batch_at(data: list, step: int, batch: int = BATCH, seed: int = SEED):
    """The batch of ``step``, a function of (seed, step) so resuming is exact: each epoch is a
    seeded permutation, cut into chunks of 64 batches sorted by length (less padding), whose
    batches are visited in a seeded order."""
    per_epoch = len(data) // batch
    epoch, k = divmod(step, per_epoch)
    rng = np.random.default_rng([seed, epoch])
    perm = rng.permutation(len(data))[: per_epoch * batch]
    order = []
    for c in range(0, len(perm), 64 * batch):
        order += sorted(perm[c : c + 64 * batch].tolist(), key=lambda i: len(data[i][0]) + len(data[i][1]))
    groups = [order[i : i + batch] for i in range(0, len(order), batch)]
    return collate([data[i] for i in groups[rng.permutation(len(groups))[k]]])


def make_model(spec: dict, dropout: float = 0.0):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(SEED)
    return T5ForConditionalGeneration(T5Config(**{**COMMON, "dropout_rate": dropout}, **spec))


def logits_at(model, x, mask, y):
    """Teacher-forced logits at the label positions ([N, V]) and their labels ([N])."""
    keep = y != -100
    return model(input_ids=x, attention_mask=mask, labels=y).logits[keep], y[keep]


def held_ce(model, data: list) -> float:
    """Teacher-forced cross-entropy (nats/token) of ``model`` on ``data``, in eval mode."""
    was = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(data), 64):
            logits, y = logits_at(model, *collate(data[i : i + 64]))
            total += float(F.cross_entropy(logits, y, reduction="sum"))
            count += len(y)
    model.train(was)
    return total / count


def fit(name: str, model, data: list, steps: int, peak_lr: float, args, teacher=None, monitor=None) -> dict:
    """``steps`` steps (AdamW, betas 0.9/0.98, weight decay 0.05); every 250 steps the cross-entropy
    on ``monitor`` (some held-out pairs; only logged, nothing is selected on it) is logged."""
    def step_loss(step):
        batch = batch_at(data, step, args.batch)  # input_ids, attention_mask [B, S]; labels [B, T]
        logits, y = logits_at(model, *batch)
        with torch.no_grad():
            soft = None if teacher is None else logits_at(teacher, *batch)[0].log_softmax(-1)
        return losses(logits, y, soft)

    def every(state):
        state.setdefault("held_log", []).append((state["step"], round(held_ce(model, monitor), 4)))
        print(f"{name} step {state['step']} held-out ce {state['held_log'][-1][1]:.3f}", flush=True)

    return train(name, model, steps, peak_lr, step_loss, args.work, args.warmup, (0.9, 0.98), 0.05, mean_ce=True, every=monitor and every)


def evaluate(target, draft, tok, data: list, pairs: list[tuple[str, str]], n_generate: int = 50) -> dict:
    """On held-out pairs: teacher-forced cross-entropy of both models, α at T=0 and T=1 over the
    label positions, and greedy exact match (output == the reference) on ``n_generate`` pairs."""
    batches = ((b, b[2][b[2] != -100]) for b in (collate(data[i : i + 64]) for i in range(0, len(data), 64)))  # labels: y at its positions
    out = agreement(target, draft, batches, lambda m, b: logits_at(m, *b)[0])
    with torch.no_grad():
        n = min(n_generate, len(pairs))
        for name, model in (("target", target), ("draft", draft)):
            hits = 0
            for (s, t), (ids, _) in zip(pairs[:n], data[:n]):
                gen = model.generate(input_ids=torch.tensor([ids]), do_sample=False, max_new_tokens=200)
                hits += tok.decode(gen[0], skip_special_tokens=True) == t
            out[f"{name}_exact_match"] = round(hits / n, 4)
    out["exact_match_pairs"] = n
    return out


def save_t5(model, tok, folder: Path) -> None:
    """``save`` with a generation config and a tokenizer that ends every encoding with eos, as the sources
    were trained, and returns only what T5 takes, so ``model.generate(**tok(text, return_tensors="pt"))`` works."""
    from tokenizers import Tokenizer, processors
    from transformers import GenerationConfig

    model.config.dropout_rate = 0.0
    model.generation_config = GenerationConfig(decoder_start_token_id=PAD, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=None)
    save(model, tok, folder)
    fast = Tokenizer.from_file(str(folder / "tokenizer.json"))
    fast.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", EOS)])
    fast.save(str(folder / "tokenizer.json"))
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["model_input_names"] = ["input_ids", "attention_mask"]
    path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def card(args, example, counts, lengths, states, figures, tparams, dparams) -> str:
    minutes = (states["target"]["seconds"] + states["draft"]["seconds"]) / 60
    src, tgt = example
    return f"""# specdec seq2seq demo pair

A T5 (encoder-decoder) target ({tparams / 1e6:.1f}M parameters) and draft ({dparams / 1e6:.2f}M), trained from scratch on
this machine by

    python tools/train/seq2seq_pair.py --target-steps {args.target_steps} --draft-steps {args.draft_steps} \\
        --target-lr {args.target_lr:g} --draft-lr {args.draft_lr:g} --dropout {args.dropout:g} --batch {args.batch} --warmup {args.warmup} --threads {args.threads}

(seed {SEED}; CPU, {args.threads} thread; {minutes:.0f} min of training: target {states['target']['seconds'] / 60:.0f} min,
draft {states['draft']['seconds'] / 60:.0f} min). They exist to demonstrate and benchmark speculative decoding of
sequence-to-sequence models, not to be useful refactoring tools.

- **Task**: local-name normalization of a Python function. The source is a function from the CPython
  stdlib; the target is the same text with the function's parameters renamed `a0, a1, ...` and its other
  local names (assignment, for, with, except and comprehension targets) `v0, v1, ...`, in order of first
  occurrence; attributes, globals, builtins, keyword-argument names, strings, comments and whitespace
  are unchanged. For example:

```python
{src.rstrip()}
```

```python
{tgt.rstrip()}
```

- **Data**: top-level functions and methods of the CPython {sys.version_info.major}.{sys.version_info.minor} standard library's `.py` files
  (no `site-packages`, no test packages) of {MIN_TOKENS}-{MAX_TOKENS} tokens with something to rename, deduplicated:
  {counts['train']:,} training pairs from {counts['train_files']} files, {counts['held']:,} held-out pairs from the
  {counts['held_files']} held-out files (a file is held out when the sha256 of its relative path is 0 mod 20, as for the
  decoder-only demo pair). Average length {lengths['source']:.1f} source and {lengths['target']:.1f} target tokens (with eos).
- **Tokenizer**: the decoder-only demo pair's byte-level BPE (4096 ids): `<|endoftext|>` (0) is eos,
  `<|pad|>` (1) is pad and the decoder start token.
- **Models**: `T5ForConditionalGeneration`, ReLU feed-forward, tied embeddings, head dimension 32, 32
  relative-position buckets (max distance 128). Target: d_model {TARGET['d_model']}, {TARGET['num_heads']} heads, d_ff {TARGET['d_ff']},
  {TARGET['num_layers']} encoder + {TARGET['num_decoder_layers']} decoder layers. Draft (own encoder): d_model {DRAFT['d_model']}, {DRAFT['num_heads']} heads,
  d_ff {DRAFT['d_ff']}, {DRAFT['num_layers']} encoder + {DRAFT['num_decoder_layers']} decoder layer.
- **Training**: batches of {args.batch} pairs, AdamW, {args.warmup} warmup steps + cosine decay, dropout {args.dropout} (saved
  configs: 0). Target: {states['target']['step']} steps of
  cross-entropy (teacher forcing). Draft: {states['draft']['step']} steps distilled from the target (0.8 × KL to the
  target's softmax at T=1 + 0.2 × cross-entropy, on the same teacher-forced positions).
- **Held-out** ({counts['held']:,} pairs, teacher-forced over all label positions): target cross-entropy
  {figures['target_ce']:.3f}, draft {figures['draft_ce']:.3f} nats/token; α = E[Σ min(p, q)] = **{figures['alpha_t1']:.3f} at T=1**,
  argmax agreement **{figures['alpha_t0']:.3f} at T=0**. Greedy decoding (`max_new_tokens=200`) reproduces the
  reference exactly on {figures['target_exact_match']:.0%} (target) and {figures['draft_exact_match']:.0%} (draft) of {figures['exact_match_pairs']} held-out pairs.
- **Format**: float16 safetensors, `config.json`, `generation_config.json`, tokenizer files; training log in
  `training.json`.
"""


def main() -> None:
    args = pair_args(__doc__, ROOT / "models" / "demo" / "seq2seq", ROOT / ".bench" / "seq2seq", "the pair cache", (1100, 800), 2e-3, 1,
                     ("--target-lr", float, 1.5e-3, None), ("--batch", int, BATCH, "pairs per step"),
                     ("--warmup", int, WARMUP, "warmup steps, then cosine decay to 0.1 x the peak"),
                     ("--dropout", float, 0.0, "while training (the saved configs say 0); a run with dropout resumes exactly only at the same "
                                               "RNG state, so not from a checkpoint"))  # fmt: skip
    tok = load_tokenizer()
    files, held = corpus_files()
    cache = args.work / "pairs.json"
    if not cache.is_file():
        cache.write_text(json.dumps([pairs_from_files(files, tok), pairs_from_files(held, tok)]))
    train_pairs, held_pairs = (list(map(tuple, p)) for p in json.loads(cache.read_text()))
    train_data, held_data = encode_pairs(tok, train_pairs), encode_pairs(tok, held_pairs)
    lengths = {side: float(np.mean([len(d[i]) for d in train_data + held_data])) for i, side in enumerate(("source", "target"))}
    counts = dict(train=len(train_pairs), held=len(held_pairs), train_files=len(files), held_files=len(held))
    print(f"{len(train_pairs)} training pairs from {len(files)} files, {len(held_pairs)} held out from {len(held)}; "
          f"{lengths['source']:.1f} source / {lengths['target']:.1f} target tokens on average", flush=True)  # fmt: skip

    target, draft = make_model(TARGET, args.dropout), make_model(DRAFT, args.dropout)
    monitor = held_data[-128:]  # evaluate() generates from the first 50
    states = {"target": fit("target", target, train_data, args.target_steps, args.target_lr, args, monitor=monitor)}
    states["draft"] = fit("draft", draft, train_data, args.draft_steps, args.draft_lr, args, freeze(target), monitor)
    t0 = time.time()
    figures = evaluate(target, draft, tok, held_data, held_pairs)
    figures.update(source_tokens=round(lengths["source"], 2), target_tokens=round(lengths["target"], 2))
    print(json.dumps(figures), f"({time.time() - t0:.0f} s)", flush=True)

    tparams, dparams = (sum(p.numel() for p in m.parameters()) for m in (target, draft))
    save_t5(target, tok, args.out / "target")
    save_t5(draft, tok, args.out / "draft")
    example = min((p for p in held_pairs if "v0" in p[1] and "a1" in p[1]), key=lambda p: len(p[0]))
    (args.out / "README.md").write_text(card(args, example, counts, lengths, states, figures, tparams, dparams))
    (args.out / "training.json").write_text(json.dumps(dict(
        args={k: str(v) for k, v in vars(args).items()}, figures=figures, counts=counts, params=dict(target=tparams, draft=dparams),
        states={k: {kk: v.get(kk) for kk in ("step", "seconds", "log", "held_log")} for k, v in states.items()}), indent=1))  # fmt: skip


if __name__ == "__main__":
    main()

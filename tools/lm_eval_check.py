"""lm-evaluation-harness against a real ``specdec serve``: loglikelihood and generate_until tasks,
checked against PyTorch.

    python tools/lm_eval_check.py --out .bench/lm-eval          # the embedded demo pair
    python tools/lm_eval_check.py --bundle B --models HF_TARGET --out DIR

lm-eval runs from its own venv (``--venv``, made on first use with the pinned ``LM_EVAL`` and a
CPU torch), as a user would run it: ``lm-eval run --model local-completions`` with the server's
own tokenizer (``/tokenizer_info`` + ``/tokenize``, lm-eval's remote tokenizer backend), so it
sends token ids. The tasks are local files (the hub is unreachable here): a multiple-choice task
(loglikelihood requests: ``echo``, ``logprobs=1``, ``max_tokens=1``) and a generate_until task
(a list of prompts, stop strings, greedy).

Checked, from lm-eval's logged samples:
- every loglikelihood equals the PyTorch target's sum of log-softmax over the continuation
  (float64) within ``TOL``, and its is_greedy flag equals PyTorch's argmax test;
- every generate_until response equals Hugging Face ``generate(do_sample=False)`` on the same
  token ids, decoded and cut at the first stop string.
Writes ``report.json`` in ``--out``; exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

LM_EVAL = "lm-eval[api]==0.4.13"  # pinned: the request shapes checked here are this version's
TORCH = "torch==2.13.0"  # a CPU wheel (an unpinned torch pulls CUDA)
TOL = 1e-4  # the export's own bound on logits against PyTorch; a sum over a few tokens stays well inside it

# A code-completion flavour, the demo pair's domain. Continuations start with their own space or
# newline: lm-eval's target_delimiter is "" here, so the text is exactly context + choice.
MULTIPLE_CHOICE = [
    ("def add(a, b):\n    return", [" a + b", " a - b", " a * b"], 0),
    ("def sub(a, b):\n    return", [" a + b", " a - b", " b"], 1),
    ("for i in range(10):\n   ", [" print(i)", " return i", " pass"], 0),
    ("class Stack:\n    def __init__(self):\n        self.items =", [" []", " {}", " None"], 0),
    ("import", [" os", " sys", " numpy as np"], 0),
    ("if __name__ ==", [" '__main__':", " 0:", " True:"], 0),
    ("with open(path) as f:\n    data =", [" f.read()", " f", " path"], 0),
    ("def push(self, x):\n    self.items.", ["append(x)", "pop()", "clear()"], 0),
]
GENERATE = [
    ("def add(a, b):\n", "    return a + b"),
    ("class Stack:\n", "    def __init__(self):"),
    ("for i in range(10):\n", "    print(i)"),
    ("import os\nimport sys\n", "import"),
    ("def mean(xs):\n", "    return sum(xs) / len(xs)"),
    ("while True:\n", "    pass"),
]
UNTIL = ["\n\n"]
MAX_GEN = 48


def ensure_venv(venv: Path) -> Path:
    """The lm-eval executable in ``venv``, installing the pinned versions first if needed."""
    exe = venv / "bin" / "lm-eval"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", TORCH, LM_EVAL], check=True)
    return exe


def write_tasks(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "mc.jsonl", "w") as f:
        for context, choices, label in MULTIPLE_CHOICE:
            f.write(json.dumps({"context": context, "choices": choices, "label": label}) + "\n")
    with open(folder / "gen.jsonl", "w") as f:
        for prompt, target in GENERATE:
            f.write(json.dumps({"prompt": prompt, "target": target}) + "\n")
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "specdec_mc.yaml").write_text(
        f"task: specdec_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\n"
        "target_delimiter: ''\nmetric_list:\n  - metric: acc\n"
    )
    (folder / "specdec_gen.yaml").write_text(
        f"task: specdec_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{target}}'\n"
        f"generation_kwargs:\n  until: {json.dumps(UNTIL)}\n  max_gen_toks: {MAX_GEN}\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n"
    )


def samples(out: Path, task: str) -> list[dict]:
    found = sorted(glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True))
    if not found:
        raise SystemExit(f"lm-eval wrote no samples for {task} under {out}")
    return [json.loads(line) for line in open(found[-1])]


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's ``_encode_pair`` for a causal model: trailing spaces move to the continuation,
    the whole text is encoded and split after the context's own tokens."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False).ids
    ctx = tok.encode(context, add_special_tokens=False).ids
    return ctx, whole[len(ctx) :]


def check_loglikelihoods(model, tok, rows: list[dict]) -> dict:
    import torch

    worst, flags, n, greedy_count = 0.0, 0, 0, 0
    for row in rows:
        doc = row["doc"]
        for i, choice in enumerate(doc["choices"]):
            ctx, cont = encode_pair(tok, doc["context"], choice)
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([ctx + cont])).logits[0].double(), -1).numpy()  # row t predicts t + 1
            rows_ = lp[len(ctx) - 1 : len(ctx) - 1 + len(cont)]
            ref = float(sum(r[t] for r, t in zip(rows_, cont)))
            greedy = all(int(r.argmax()) == t for r, t in zip(rows_, cont))
            got, got_greedy = row["resps"][i][0]  # logged as strings: "-5.51...", "False"
            worst = max(worst, abs(float(got) - ref))
            flags += (str(got_greedy) == "True") != greedy
            greedy_count += greedy
            n += 1
    return {"requests": n, "max_abs_diff": worst, "is_greedy_mismatches": flags, "greedy_continuations": greedy_count,
            "ok": worst <= TOL and flags == 0}


def check_generations(model, tok, rows: list[dict]) -> dict:
    import torch

    equal, n, diffs = 0, 0, []
    for row in rows:
        ids = tok.encode(row["doc"]["prompt"], add_special_tokens=False).ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
                                 max_new_tokens=MAX_GEN, pad_token_id=model.config.eos_token_id)  # fmt: skip
        text = tok.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True)
        for stop in UNTIL:
            text = text.split(stop)[0]
        got = row["resps"][0][0]
        n += 1
        equal += got == text
        if got != text:
            diffs.append({"prompt": row["doc"]["prompt"], "lm_eval": got, "pytorch": text})
    nonempty = sum(bool(row["resps"][0][0]) for row in rows)
    return {"requests": n, "equal": equal, "nonempty": nonempty, "differences": diffs[:3], "ok": equal == n and nonempty > 0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, default=None, help="[default: the embedded demo pair's bundle]")
    ap.add_argument("--models", type=Path, default=None, help="the target's Hugging Face folder [default: the demo's]")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--venv", type=Path, default=Path(".bench/lmeval-venv"))
    a = ap.parse_args()
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from specdec import demo
    from specdec.serve.process import ServerProcess

    bundle, target = a.bundle, a.models
    if bundle is None:
        bundle, _ = demo.bundle_for(demo.default_models())
        target = target or demo.default_models() / "target"
    if target is None:
        raise SystemExit("--models: the target's Hugging Face folder is needed for the PyTorch reference")
    exe = ensure_venv(a.venv)
    a.out.mkdir(parents=True, exist_ok=True)
    write_tasks(a.out / "tasks")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OPENAI_API_KEY": "none"}
    t0 = time.perf_counter()
    with ServerProcess(bundle, "--served-model-name", "specdec", "--log-level", "warning", log=a.out / "server.log") as server:
        server.wait_ready(300)
        cmd = [str(exe), "run", "--model", "local-completions", "--tasks", "specdec_mc,specdec_gen", "--include_path", str(a.out / "tasks"),
               "--model_args", f"base_url={server.url}/v1/completions,model=specdec,num_concurrent=1,max_retries=1,tokenizer_backend=remote",
               "--log_samples", "--output_path", str(a.out / "results")]  # fmt: skip
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    (a.out / "lm_eval.log").write_text(run.stdout + run.stderr)
    if run.returncode != 0:
        print(run.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"lm-eval exited with {run.returncode}; its log: {a.out / 'lm_eval.log'}")
    model = AutoModelForCausalLM.from_pretrained(target, dtype="float32").eval()
    tok = Tokenizer.from_file(str(bundle / "tokenizer" / "tokenizer.json"))
    version = subprocess.run([str(a.venv / "bin" / "python"), "-c", "import lm_eval; print(lm_eval.__version__)"], capture_output=True, text=True).stdout.strip()
    results = json.loads(open(sorted(glob.glob(str(a.out / "results" / "**" / "results_*.json"), recursive=True))[-1]).read())["results"]
    report = {
        "lm_eval": version,
        "bundle": str(bundle),
        "seconds": round(time.perf_counter() - t0, 1),
        "metrics": {task: {k: v for k, v in r.items() if isinstance(v, (int, float))} for task, r in results.items()},
        "loglikelihood": check_loglikelihoods(model, tok, samples(a.out / "results", "specdec_mc")),
        "generate_until": check_generations(model, tok, samples(a.out / "results", "specdec_gen")),
    }
    (a.out / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0 if report["loglikelihood"]["ok"] and report["generate_until"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

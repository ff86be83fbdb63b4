#!/usr/bin/env python3
"""llama.cpp's side of ``tools/bench_quality.py``: logits of held-out windows and greedy
continuations of prompts for one GGUF file, through llama-cpp-python. Runs under the llama.cpp
venv's python (``.bench/llamacpp-venv/bin/python``; needs numpy and llama_cpp only)::

    llamacpp_quality.py '{"gguf": FILE, "windows": [[ids]], "prompts": [[ids]], "steps": 48,
                          "threads": 2, "out": DIR}'

Writes ``DIR/logits.npy`` (float32 [sum of window lengths, V]: every window evaluated from an
empty context, as ``specdec.bench.quality`` does for a bundle) and ``DIR/greedy.json``
(``{"tokens": [[...]], "tokens_per_second": x}``). Greedy is the argmax of llama.cpp's logits
after each single-token ``eval`` (no sampler, EOS ignored); tokens/s counts the decoding after
the prefill, one token per call, as specdec's autoregressive figure does.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
from llama_cpp import Llama


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    n_ctx = max([len(w) for w in spec["windows"]] + [len(p) + spec["steps"] for p in spec["prompts"]]) + 8
    common = dict(model_path=spec["gguf"], n_ctx=n_ctx, n_batch=n_ctx, n_threads=spec["threads"],
                  n_threads_batch=spec["threads"], verbose=False)

    llm = Llama(logits_all=True, **common)
    vocab = llm.n_vocab()
    rows = sum(len(w) for w in spec["windows"])
    logits = np.lib.format.open_memmap(out / "logits.npy", mode="w+", dtype=np.float32, shape=(rows, vocab))
    start = 0
    for w in spec["windows"]:
        llm.reset()
        llm.eval(w)
        logits[start : start + len(w)] = llm.scores[: len(w)]
        start += len(w)
    logits.flush()
    del llm

    llm = Llama(logits_all=False, **common)
    # Without logits_all the binding keeps no scores: the context's logits are the last token's row.
    last = lambda: np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))  # noqa: E731
    tokens, seconds, decoded = [], 0.0, 0
    for p in spec["prompts"]:
        llm.reset()
        llm.eval(p)
        got = [int(np.argmax(last()))]
        t0 = time.perf_counter()
        for _ in range(spec["steps"] - 1):
            llm.eval([got[-1]])
            got.append(int(np.argmax(last())))
        seconds += time.perf_counter() - t0
        decoded += len(got) - 1
        tokens.append(got)
    (out / "greedy.json").write_text(json.dumps({"tokens": tokens, "tokens_per_second": decoded / seconds}))


if __name__ == "__main__":
    main()

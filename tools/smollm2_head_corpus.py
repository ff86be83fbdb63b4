#!/usr/bin/env python3
"""SmolLM2's own chat answers as a text corpus for ``specdec train-drafter``.

    python tools/smollm2_data.py prompts && python tools/smollm2_data.py generate --minutes 15
    python tools/smollm2_head_corpus.py            # -> .bench/smollm2/head-corpus/gen-XXXX.txt
    specdec train-drafter BUNDLE --corpus .bench/smollm2/head-corpus --draft-vocab 8192 ...

Each generated shard (prompts through the chat template, and the target's answers, half
greedy and half sampled at T=1) becomes one text file, conversations as the model saw them,
special tokens kept: EAGLE's recipe of training the head on the target's own outputs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".bench" / "smollm2"


def main() -> None:
    from tokenizers import Tokenizer

    sys.path.insert(0, str(ROOT / "tools"))
    from smollm2_data import checkpoint

    tok = Tokenizer.from_file(str(checkpoint() / "tokenizer.json"))
    out = WORK / "head-corpus"
    out.mkdir(parents=True, exist_ok=True)
    shards = sorted(WORK.glob("gen-*.npz"))
    if not shards:
        sys.exit(f"no shards in {WORK}: run tools/smollm2_data.py prompts and generate first")
    tokens = 0
    for path in shards:
        shard = np.load(path, allow_pickle=True)
        texts = []
        for prompt, answer in zip(shard["prompt"], shard["answer"]):
            ids = [int(t) for t in prompt] + [int(t) for t in answer]
            texts.append(tok.decode(ids, skip_special_tokens=False))
            tokens += len(ids)
        (out / f"{path.stem}.txt").write_text("\n".join(texts))
    print(f"{len(shards)} shards -> {out} ({tokens:,} tokens)")


if __name__ == "__main__":
    main()

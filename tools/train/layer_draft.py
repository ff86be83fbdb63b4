"""A layer-initialized shared draft for any GGUF or checkpoint target: its first N layers and final
norm, untrained, over the V' token ids most frequent in local text (docs/*.md and the stdlib's
sources, counted with the target's tokenizer). How models/gemma3-270m-draft's draft was made:

    python tools/train/layer_draft.py --target <Gemma-3-270M's GGUF> --layers 1 --vocab 8192 --out models/gemma3-270m-draft
"""

from __future__ import annotations

import argparse
import glob
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from smollm2_draft import build  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def load(target: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(target)
    kw = dict(gguf_file=p.name) if p.suffix.lower() == ".gguf" else {}
    where = str(p.parent) if kw else target
    return AutoTokenizer.from_pretrained(where, **kw), AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw).eval()


def local_vocab(tok, vocab: int, size: int) -> list[int]:
    """The ``size`` ids most frequent in local text; unseen ids ranked by id (ties broken low)."""
    files = sorted(glob.glob(str(ROOT / "docs" / "*.md")))[:40] + sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))[:80]
    counts = np.zeros(vocab, np.int64)
    for f in files:
        np.add.at(counts, np.array(tok(Path(f).read_text(errors="ignore")).input_ids), 1)
    return sorted(int(i) for i in np.argsort(-(counts + 1.0 / (1.0 + np.arange(vocab) / size)))[:size])


def main() -> None:
    from specdec.export import shared_draft

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="a GGUF file or a checkpoint folder")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    tok, target = load(a.target)
    ids = local_vocab(tok, target.config.vocab_size, a.vocab)
    shared_draft.save(build(target, a.layers), a.out, ids, tok)
    print(f"{a.out}: {a.layers} layer(s) of {a.target}, V' = {len(ids)}")


if __name__ == "__main__":
    main()

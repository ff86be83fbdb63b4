"""``specdec-export --ngram-corpus PATH``: the n-gram drafter's table, counted from a text corpus.

The corpus is a text file or a folder (every file under it that is valid UTF-8; others are
skipped and counted). It is tokenized with the target's tokenizer and reduced to the most
frequent successor of each token plus the most frequent token (``NgramTable``), saved as
``ngram.npz`` and named, with its sha256, in the manifest.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specdec.errors import ConfigError
from specdec.manifest import sha256_of
from specdec.ngram_table import FILE, NgramTable


def check_corpus(path: Path | None, has_tokenizer: bool) -> None:
    """Refuse a bad --ngram-corpus before any weights load."""
    if path is None:
        return
    if not path.exists():
        raise ConfigError(f"--ngram-corpus {path}: no such file or folder; pass a text file or a folder of text files")
    if not has_tokenizer:
        raise ConfigError(f"--ngram-corpus {path}: the target has no tokenizer to count tokens with; export without --ngram-corpus")


def corpus_texts(path: Path) -> tuple[list[str], int]:
    """The UTF-8 texts under ``path``, and how many files were skipped as not text."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    texts, skipped = [], 0
    for f in files:
        try:
            texts.append(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            skipped += 1
    return texts, skipped


def write_table(path: Path, tokenizer, vocab: int, out: Path) -> dict:
    """Count the corpus into ``out / FILE``; returns the manifest entry."""
    texts, skipped = corpus_texts(path)
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    tokens = np.fromiter((i for seq in ids for i in seq), dtype=np.int64)  # [N], files back to back
    if tokens.size < 2:
        raise ConfigError(f"--ngram-corpus {path}: found {tokens.size} tokens in {len(texts)} text files; need at least 2")
    NgramTable.count(tokens, vocab).save(out / FILE)
    return {"file": FILE, "sha256": sha256_of(out / FILE), "corpus": str(path), "files": len(texts), "skipped": skipped, "tokens": int(tokens.size)}

"""A shared draft's config-level half (export/shared_draft.py holds the weights' half): what
the export checks before any weights load, without importing torch, so a refusal is quick."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

from specdec.errors import ModelError

KEY = "specdec_draft"
FILL = -1e4  # the logit of a token outside the draft's subset; finite, so float16 graphs hold it too


def spec_of(config: Any) -> dict | None:
    """The config's ``specdec_draft`` entry, or None for an ordinary checkpoint."""
    spec = getattr(config, KEY, None)
    return spec if isinstance(spec, dict) else None


CHUNKS = 256  # the vocabulary's fingerprint: a short digest per 1/256 of its ids
CHUNKS_MAY_DIFFER = 2  # a tokenizer converter's own differences touch a token or two (below); another vocabulary touches all


def vocab_digest(tokenizer: Any) -> str:
    """A digest of a tokenizer's token -> id map: which target a shared draft was trained for."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()


def vocab_chunks(tokenizer: Any) -> list[str]:
    """The vocabulary's ids cut into CHUNKS runs, each run's tokens digested (8 hex digits).
    One token that a transformers version spells otherwise changes one run's digest, not the
    whole digest: Gemma 3's GGUF has two entries for the tab byte, and transformers 4.57 keeps
    one of them (id 247 has no token) where 5.24 names it ``<0x09>``."""
    ids = {i: t for t, i in tokenizer.get_vocab().items()}
    n = max(ids) + 1
    per = -(-n // CHUNKS)
    return [hashlib.sha256(json.dumps([ids.get(i) for i in range(c * per, min(n, (c + 1) * per))]).encode()).hexdigest()[:8]
            for c in range(CHUNKS)]  # fmt: skip


def target_fields(tokenizer: Any) -> dict:
    """What a shared draft's config records of the target it was trained for."""
    return {"target_vocab_sha256": vocab_digest(tokenizer), "target_vocab_chunks": vocab_chunks(tokenizer)}


def check_target(folder: Path, spec: dict, target_tokenizer: Any) -> None:
    """Refuse a shared draft trained for another vocabulary (it has no tokenizer of its own).
    The whole map's digest decides when it matches; else the run digests do, allowing
    CHUNKS_MAY_DIFFER runs to differ (with a warning: the output stays the target's whatever the
    draft proposes, so a token spelled otherwise costs acceptance at most)."""
    want = spec.get("target_vocab_sha256")
    if not want or target_tokenizer is None or vocab_digest(target_tokenizer) == want:
        return
    chunks = spec.get("target_vocab_chunks")
    differ = sum(a != b for a, b in zip(vocab_chunks(target_tokenizer), chunks)) if chunks and len(chunks) == CHUNKS else CHUNKS
    if differ > CHUNKS_MAY_DIFFER:
        raise ModelError(
            f"shared draft {folder} was trained for another target vocabulary (target_vocab_sha256 {want[:12]}…"
            f"{f', {differ} of {CHUNKS} runs of ids differ' if chunks else ''}); pass the target it was trained for, "
            "or an ordinary draft checkpoint"
        )  # fmt: skip
    warnings.warn(f"shared draft {folder}: {differ} of {CHUNKS} runs of the target's vocabulary ids differ from the one it was trained for "
                  "(a tokenizer version's spelling of a token or two); it drafts as trained, and the output stays the target's",
                  stacklevel=2)  # fmt: skip

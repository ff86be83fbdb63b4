"""A shared draft's config-level half (export/shared_draft.py holds the weights' half): what
the export checks before any weights load, without importing torch, so a refusal is quick."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from specdec.errors import ModelError

KEY = "specdec_draft"
FILL = -1e4  # the logit of a token outside the draft's subset; finite, so float16 graphs hold it too


def spec_of(config: Any) -> dict | None:
    """The config's ``specdec_draft`` entry, or None for an ordinary checkpoint."""
    spec = getattr(config, KEY, None)
    return spec if isinstance(spec, dict) else None


def vocab_digest(tokenizer: Any) -> str:
    """A digest of a tokenizer's token -> id map: which target a shared draft was trained for."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()


def check_target(folder: Path, spec: dict, target_tokenizer: Any) -> None:
    """Refuse a shared draft trained for another vocabulary (it has no tokenizer of its own)."""
    want = spec.get("target_vocab_sha256")
    if want and target_tokenizer is not None and vocab_digest(target_tokenizer) != want:
        raise ModelError(
            f"shared draft {folder} was trained for another target vocabulary (target_vocab_sha256 {want[:12]}…); "
            "pass the target it was trained for, or an ordinary draft checkpoint"
        )

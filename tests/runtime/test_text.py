"""Incremental detokenization: the deltas of a stream add up to the decoded text, piece by piece."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from specdec.runtime.text import REPLACEMENT, Detokenizer, TextCodec

TOKENIZER = Path(__file__).resolve().parents[2] / "models" / "demo" / "target" / "tokenizer.json"
TEXT = "def café(x):\n    return 'naïve — ünïcödé ✓ 🐍' * 2  # done\n\nclass Ω: pass\n"


@pytest.mark.parametrize("seed", range(5))
def test_deltas_add_up_to_the_text_for_any_chunking(seed):
    codec = TextCodec(TOKENIZER)
    ids = codec.encode(TEXT)
    want = codec.decode(ids)
    rng = np.random.default_rng(seed)
    detok, out, i = Detokenizer(codec), [], 0
    while i < len(ids):
        n = int(rng.integers(1, 4))
        delta = detok.push(ids[i : i + n])
        assert REPLACEMENT not in delta  # never half a character
        out.append(delta)
        assert want.startswith("".join(out))  # every prefix so far is right
        i += n
    out.append(detok.flush())
    assert "".join(out) == want
    assert detok.prefix == len(ids)  # the window moved along: later pushes decode only new tokens

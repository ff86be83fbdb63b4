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


def _texts(codec: TextCodec, rng) -> list[str]:
    """Texts that pack the most characters into the fewest tokens: the vocabulary's longest
    entries repeated (decoded), whitespace runs, composed and decomposed accents, random entries."""
    vocab = codec.tokenizer.get_vocab()
    longest = sorted(vocab, key=len)[-5:]
    texts = [codec.decode([vocab[e]]) * 50 for e in longest]
    texts += [" " * 5000, "\n" * 3000, "\t \n" * 999, "e\u0301" * 2000, "é" * 2000, TEXT * 20]
    ids = rng.integers(0, codec.tokenizer.get_vocab_size(), size=(20, 200))
    texts += [codec.decode(row.tolist()) for row in ids]
    return texts


@pytest.mark.parametrize("tokenizer", ["demo", "tiny"])
def test_no_text_over_max_chars_fits_its_token_count(tokenizer, tmp_path):
    """max_chars(n) bounds the characters of any text that encodes to n tokens: the server
    refuses longer prompts without tokenizing them (serve/app.py ``encode``)."""
    if tokenizer == "tiny":
        from models import make_tokenizer  # the byte-level BPE the export tests train

        make_tokenizer(tmp_path)
        path = tmp_path / "tokenizer.json"
    else:
        path = TOKENIZER
    codec = TextCodec(path)
    rng = np.random.default_rng(0)
    tightest = 0.0
    for text in _texts(codec, rng):
        n = len(codec.encode(text, special=False))
        assert len(text) <= codec.max_chars(n), (text[:40], n, codec.max_chars(n))
        tightest = max(tightest, len(text) / codec.max_chars(max(n, 1)))
    assert tightest > 0.05  # the texts come near the bound: a bound 20x looser would be useless

"""The encoder-decoder families users deploy for translation and summarization beyond T5, BART
and Marian: mT5 (and Flan-T5's gated-GELU blocks), UMT5 (a relative bias table per layer),
mBART and Pegasus (pre-LayerNorm blocks; Pegasus with sinusoidal positions). Each tiny pair is
exported (validated against PyTorch there), then decoded greedily, autoregressive and
speculative, token for token against ``transformers``' own greedy loop; UMT5 and mBART (the
code paths T5, BART and Marian do not take) also with rows graphs, their sources decoded 2 rows
to a call by BatchEngine. Encoder-decoder
architectures we do not export are refused by name at the start."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from models import load_seq2seq, save_seq2seq_pair, seq2seq_greedy  # noqa: E402

from specdec.errors import ModelError  # noqa: E402
from specdec.export.families import family_of  # noqa: E402
from specdec.export.pipeline import ExportConfig, export_bundle  # noqa: E402
from specdec.runtime import BatchEngine, SpeculativeDecoder  # noqa: E402

SOURCES = [[5, 17, 42, 99, 7, 3, 250, 61, 1], [30, 31, 32, 33, 34, 30, 31, 1], [9, 8, 7, 1]]


@pytest.mark.parametrize("family", ["mt5", "umt5", "mbart", "pegasus"])
def test_family_decodes_as_transformers(family, tmp_path):
    target, draft = save_seq2seq_pair(tmp_path, family)
    rows = 2 if family in ("umt5", "mbart") else 1
    m = export_bundle(ExportConfig(str(target), str(draft), tmp_path / "b", gamma=4, max_seq_len=96, max_source_len=32, max_batch=rows))
    assert m.seq2seq and m.validation["target"]["top1_agreement"] == 1.0
    model, dec = load_seq2seq(target), SpeculativeDecoder.load(tmp_path / "b")
    accepted = 0
    for src in SOURCES:
        want = seq2seq_greedy(model, src, 24)
        assert dec.generate(src, max_new_tokens=24, ignore_eos=True, gamma=0).tokens == want, (family, src)
        res = dec.generate(src, max_new_tokens=24, ignore_eos=True)
        assert res.tokens == want, (family, src)
        accepted += res.stats.accepted
    assert accepted > 0, f"{family}: the near draft never had a token accepted"
    if rows > 1:
        assert m.validation["target_rows"]["top1_agreement"] == 1.0
        with BatchEngine(tmp_path / "b") as engine:
            results = engine.generate_many(SOURCES, max_new_tokens=24, ignore_eos=True)
            assert max(engine.occupancy) == 2
        assert [r.tokens for r in results] == [seq2seq_greedy(model, src, 24) for src in SOURCES], family


@pytest.mark.parametrize("model_type, why", [("longt5", "local and transient-global attention"), ("led", "sliding-window"),
                                             ("pegasus_x", "block-local"), ("m2m_100", "M2M100/NLLB")])  # fmt: skip
def test_other_encoder_decoders_are_refused_by_name(model_type, why):
    from transformers import AutoConfig

    with pytest.raises(ModelError, match=f"architecture '{model_type}' is not supported: .*{why}"):
        family_of(AutoConfig.for_model(model_type), "src")

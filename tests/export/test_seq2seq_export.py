"""specdec-export for encoder-decoder models: a tied T5 head and a draft of another shape, and
the options an encoder-decoder bundle refuses (one line, exit 2, nothing written)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from models import load_seq2seq, save_seq2seq_pair, seq2seq_greedy  # noqa: E402
from test_bad_input import assert_one_line_error, export_cli  # noqa: E402
from test_cli import run  # noqa: E402

from specdec.runtime import SpeculativeDecoder  # noqa: E402


@pytest.fixture(scope="module")
def tied_t5(tmp_path_factory):
    """A tied T5 target (its head scaled by d_model^-0.5) with gated-GELU feed-forwards (T5 v1.1,
    flan-T5) and a smaller random T5 draft: ReLU, other layer and head counts, its own encoder.
    Their configs name no BOS, as t5-small's does not (transformers 5.x has no default)."""
    root = tmp_path_factory.mktemp("t5tied")
    pair = save_seq2seq_pair(root, "t5", near=False, tied=True, feed_forward_proj="gated-gelu")
    for folder in pair:
        config = json.loads((folder / "config.json").read_text())
        del config["bos_token_id"]
        (folder / "config.json").write_text(json.dumps(config))
    return pair


def test_tied_t5_with_a_smaller_draft(tied_t5, tmp_path):
    target, draft = tied_t5
    out = tmp_path / "bundle"
    res = export_cli("--target", str(target), "--draft", str(draft), "--out", str(out), "--gamma", "3", "--max-seq-len", "96", "--max-source-len", "32")
    assert res.returncode == 0, res.stderr[-2000:]
    m = json.loads((out / "manifest.json").read_text())
    assert (m["target"]["num_layers"], m["draft"]["num_layers"], m["draft"]["num_heads"]) == (2, 1, 2)
    assert m["validation"]["target"]["logits"] < 1e-4 and m["validation"]["draft"]["logits"] < 1e-4
    dec = SpeculativeDecoder.load(out)
    model = load_seq2seq(target)
    for source in ([5, 17, 42, 99, 7, 3, 250, 61, 1], [30, 31, 32, 33, 34, 30, 31, 32, 1]):
        assert dec.generate(source, max_new_tokens=40, ignore_eos=True).tokens == seq2seq_greedy(model, source, 40)
    inspect = run("inspect", str(out))
    assert "encoder-decoder: max-source-len 32  decoder start 2" in inspect.stdout


@pytest.mark.parametrize(
    "args, words",
    [
        (("--fused-draft",), ("--fused-draft", "not supported for encoder-decoder bundles yet")),
        (("--portable",), ("--portable", "not supported for encoder-decoder bundles yet")),
        (("--max-source-len", "1"), ("--max-source-len 1", "expected an integer >= 2")),
    ],
)
def test_options_an_encoder_decoder_refuses(tied_t5, tmp_path, args, words):
    target, draft = tied_t5
    out = tmp_path / "bundle"
    assert_one_line_error(export_cli("--target", str(target), "--draft", str(draft), "--out", str(out), *args), *words)
    assert not out.exists()


def test_per_size_batch_graphs_are_refused(tied_t5, tmp_path):
    """Encoder-decoder batched graphs come as rows graphs only (tests/runtime/test_seq2seq.py
    decodes them): ``--batch-graphs per-size`` is refused with one line, nothing written."""
    target, draft = tied_t5
    out = tmp_path / "bundle"
    refused = export_cli("--target", str(target), "--draft", str(draft), "--out", str(out), "--max-batch", "4", "--batch-graphs", "per-size")
    assert_one_line_error(refused, "--batch-graphs per-size", "not supported for encoder-decoder bundles yet")
    assert not out.exists()


def test_source_longer_than_the_encoders_positions(tmp_path):
    target, draft = save_seq2seq_pair(tmp_path, "bart")  # max_position_embeddings 256
    out = tmp_path / "bundle"
    res = export_cli("--target", str(target), "--draft", str(draft), "--out", str(out), "--max-source-len", "300")
    assert_one_line_error(res, "--max-source-len 300 exceeds the encoders' 256 positions", "pass --max-source-len 256")
    assert not out.exists()


def test_mixed_pairs_are_refused(tied_t5, llama_bundle, tmp_path):
    target, _ = tied_t5
    llama_target = llama_bundle[0]
    out = tmp_path / "bundle"
    res = export_cli("--target", str(target), "--draft", str(llama_target), "--out", str(out))
    assert_one_line_error(res, "is an encoder-decoder model (t5) but draft", "a decoder-only one (llama)")
    # the others in process: the command line's one-line error is the same path for every refusal
    from transformers import AutoConfig

    from specdec.errors import ConfigError, ModelError
    from specdec.export.pipeline import ExportConfig, export_bundle

    with pytest.raises(ConfigError, match="--max-source-len 64: .* is decoder-only"):
        export_bundle(ExportConfig(str(llama_target), str(llama_target), out, max_source_len=64))
    import shutil

    other = tmp_path / "other"  # a draft whose decoder starts elsewhere

    shutil.copytree(tied_t5[1], other)
    cfg = AutoConfig.from_pretrained(other)
    cfg.decoder_start_token_id = 0
    cfg.save_pretrained(other)
    with pytest.raises(ModelError, match="decoder_start_token_id=2, draft decoder_start_token_id=0"):
        export_bundle(ExportConfig(str(target), str(other), out))
    assert not out.exists()


@pytest.mark.parametrize("flags", [{"quantize": "int8"}, {"dtype": "float16"}], ids=["int8", "float16"])
def test_quantized_and_half_bundles_decode_as_their_own_target(tied_t5, tmp_path, flags):
    """Weight-only int8 and float16 change the model, so the reference is the bundle's own
    autoregressive output: speculative greedy must equal it token for token."""
    from specdec.export.pipeline import ExportConfig, export_bundle  # in process: the CLI's path is the test above's

    target, draft = tied_t5
    out = tmp_path / "bundle"
    export_bundle(ExportConfig(str(target), str(draft), out, max_seq_len=96, max_source_len=32, **flags))
    dec = SpeculativeDecoder.load(out)
    for source in ([5, 17, 42, 99, 7, 3, 250, 61, 1], [30, 31, 32, 33, 34, 30, 31, 32, 1]):
        own = dec.generate(source, max_new_tokens=30, gamma=0, ignore_eos=True).tokens
        for gamma in (2, 3):
            assert dec.generate(source, max_new_tokens=30, gamma=gamma, ignore_eos=True).tokens == own

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


def test_max_batch_exports_rows_graphs_that_decode_requests_together(tied_t5, tmp_path):
    """``--max-batch 4`` on an encoder-decoder pair: a rows graph per model (bodies of 1, 2 and
    4 rows, each row over its own source) and a batched encoder (padded, masked), validated at
    export; 8 requests of sources of different lengths submitted at once to its BatchEngine run 4
    rows to a call, the 4 sources admitted together encoded in one call per model, each request
    token for token as PyTorch's greedy loop. ``--batch-graphs per-size`` is refused with one line."""
    from specdec.runtime import BatchEngine

    target, draft = tied_t5
    out = tmp_path / "bundle"
    res = export_cli("--target", str(target), "--draft", str(draft), "--out", str(out), "--max-batch", "4", "--max-source-len", "32")
    assert res.returncode == 0, res.stderr[-2000:]
    m = json.loads((out / "manifest.json").read_text())
    assert [m["graphs"][f"{model}_rows"]["rows"] for model in ("target", "draft")] == [[1, 2, 4]] * 2
    assert [m["graphs"][f"{model}_encoder_rows"]["io"]["mask"] for model in ("target", "draft")] == ["attention_mask"] * 2
    assert all(m["validation"][f"{model}_rows"]["top1_agreement"] == 1.0 for model in ("target", "draft"))
    engine = BatchEngine(out)
    try:
        assert engine.max_batch == 4
        sources = [[5 + i, 17, 42, 99 - i, 7, 3, 250, 61, 1][: 3 + i % 6] for i in range(8)]
        results = engine.generate_many(sources, max_new_tokens=16, ignore_eos=True, gamma=0)  # plain: the 4 rows end together
        assert max(engine.occupancy) == 4
        assert [model.encodes for model in engine.engine.models] == [2, 2]  # 8 sources, 4 at a time
    finally:
        engine.close()
    model = load_seq2seq(target)
    assert [r.tokens for r in results] == [seq2seq_greedy(model, s, 16) for s in sources]
    one_source_through_both_encoders(out)
    refused = export_cli("--target", str(target), "--draft", str(draft), "--out", str(tmp_path / "b2"), "--max-batch", "4", "--batch-graphs", "per-size")
    assert_one_line_error(refused, "--batch-graphs per-size", "not supported for encoder-decoder bundles yet")


def one_source_through_both_encoders(out) -> None:
    """A rows engine runs a lone source through the batched encoder (B = 1, below the B >= 2 it
    was traced at): its K/V are the batch-1 encoder's, to float32 rounding (1e-5: both are the
    same float32 ops over the same weights; only the kernels' shapes differ)."""
    import numpy as np

    from specdec.engines.kv import CrossKV
    from specdec.engines.ort import BatchEncoder, EncoderRunner, open_session
    from specdec.manifest import load_manifest

    m = load_manifest(out)
    spec = m.target
    crosses = [CrossKV(spec.num_layers, spec.num_heads, m.max_source_len, spec.head_dim, m.dtype) for _ in range(2)]
    one, rows = m.graph("target", "encoder"), next((n, g) for n, g in m.graphs.items() if g.role == "encoder" and g.model == "target" and g.batch > 1)
    source = np.array([5, 17, 42, 99, 7, 3, 250, 61, 1])
    EncoderRunner(open_session(out, *one), *one, crosses[0]).run(source)
    BatchEncoder(open_session(out, *rows), *rows, 4, m.max_source_len).run([source], crosses[1:])
    assert crosses[0].length == crosses[1].length == len(source)
    assert max(float(np.abs(a - b).max()) for a, b in zip(crosses[0].views(), crosses[1].views())) < 1e-5


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
    res = export_cli("--target", str(llama_target), "--draft", str(llama_target), "--out", str(out), "--max-source-len", "64")
    assert_one_line_error(res, "--max-source-len 64", "is decoder-only")
    # a draft whose decoder starts elsewhere
    from transformers import AutoConfig

    other = tmp_path / "other"
    import shutil

    shutil.copytree(tied_t5[1], other)
    cfg = AutoConfig.from_pretrained(other)
    cfg.decoder_start_token_id = 0
    cfg.save_pretrained(other)
    res = export_cli("--target", str(target), "--draft", str(other), "--out", str(out))
    assert_one_line_error(res, "decoder_start_token_id=2", "decoder_start_token_id=0")
    assert not out.exists()


@pytest.mark.parametrize("flags", [("--quantize", "int8"), ("--dtype", "float16")])
def test_quantized_and_half_bundles_decode_as_their_own_target(tied_t5, tmp_path, flags):
    """Weight-only int8 and float16 change the model, so the reference is the bundle's own
    autoregressive output: speculative greedy must equal it token for token."""
    target, draft = tied_t5
    out = tmp_path / "bundle"
    res = export_cli("--target", str(target), "--draft", str(draft), "--out", str(out), "--max-seq-len", "96", "--max-source-len", "32", *flags)
    assert res.returncode == 0, res.stderr[-2000:]
    dec = SpeculativeDecoder.load(out)
    for source in ([5, 17, 42, 99, 7, 3, 250, 61, 1], [30, 31, 32, 33, 34, 30, 31, 32, 1]):
        own = dec.generate(source, max_new_tokens=30, gamma=0, ignore_eos=True).tokens
        for gamma in (2, 3):
            assert dec.generate(source, max_new_tokens=30, gamma=gamma, ignore_eos=True).tokens == own

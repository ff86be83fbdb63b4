from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/models.py
pytest_plugins = ["timing"]  # the time budget, reported every run (tests/timing.py)


def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly on machines without CUDA (CI never has one)."""
    try:
        import onnxruntime as ort

        has_cuda = "CUDAExecutionProvider" in ort.get_available_providers()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA GPU and onnxruntime-gpu")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def llama_bundle(tmp_path_factory):
    """A llama target/draft pair on disk and its exported bundle (γ = 4, max-seq-len 128), with
    an n-gram table counted from the tokenizer's corpus (a folder with one text file)."""
    pytest.importorskip("torch")
    from models import CORPUS, save_pair

    from specdec.export.pipeline import ExportConfig, export_bundle

    root = tmp_path_factory.mktemp("llama")
    target, draft = save_pair(root, "llama")
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "code.py").write_text(CORPUS)
    (corpus / "blob.bin").write_bytes(bytes(range(256)))  # not text: skipped
    out = root / "bundle"
    export_bundle(ExportConfig(str(target), str(draft), out, gamma=4, max_seq_len=128, ngram_corpus=corpus))
    return target, draft, out


FAMILIES = ["llama", "qwen2", "qwen3", "phi3", "gemma3", "gemma2", "mistral", "gpt2", "opt", "gpt_neox"]


@pytest.fixture(scope="session", params=FAMILIES)
def family_bundle(request, tmp_path_factory):
    """Per family: a target, a near draft (a noisy copy, so decoding accepts and rejects), and
    their bundle (γ = 4, max-seq-len 192, batched graphs for 2 and 4 rows). Shared by the
    export and runtime tests. The llama bundle also has fused draft graphs (--fused-draft), so
    its decoding tests run the fused path at γ = 4 (and the step path at other γ); the other
    families' fused graphs are checked graph by graph (tests/export/test_fused.py), which keeps
    ~2 minutes of export per family out of the suite."""
    pytest.importorskip("torch")
    from models import save_pair

    from specdec.export.pipeline import ExportConfig, export_bundle

    root = tmp_path_factory.mktemp(request.param)
    target, draft = save_pair(root, request.param, near=0.1)
    out = root / "bundle"
    manifest = export_bundle(ExportConfig(str(target), str(draft), out, gamma=4, max_seq_len=192, max_batch=4, fused_draft=request.param == "llama"))
    return request.param, target, draft, out, manifest


@pytest.fixture(scope="session", params=["t5", "bart", "marian"])
def seq2seq_bundle(request, tmp_path_factory):
    """Per encoder-decoder family: a target, a near draft (a noisy copy with its own encoder) and
    their bundle (γ = 4, max-seq-len 160, max-source-len 64)."""
    pytest.importorskip("torch")
    from models import save_seq2seq_pair

    from specdec.export.pipeline import ExportConfig, export_bundle

    root = tmp_path_factory.mktemp(request.param)
    target, draft = save_seq2seq_pair(root, request.param)
    out = root / "bundle"
    manifest = export_bundle(ExportConfig(str(target), str(draft), out, gamma=4, max_seq_len=160, max_source_len=64))
    return request.param, target, draft, out, manifest

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/models.py


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
    """A llama target/draft pair on disk and its exported bundle (γ = 4, max-seq-len 128)."""
    pytest.importorskip("torch")
    from models import save_pair

    from specdec.export.pipeline import ExportConfig, export_bundle

    root = tmp_path_factory.mktemp("llama")
    target, draft = save_pair(root, "llama")
    out = root / "bundle"
    export_bundle(ExportConfig(str(target), str(draft), out, gamma=4, max_seq_len=128))
    return target, draft, out

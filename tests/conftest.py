from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/models.py, tests/bundles.py
pytest_plugins = ["timing"]  # the time budget, reported every run (tests/timing.py)


def pytest_configure(config):
    """Under pytest-xdist the workers share the cores: one ONNX Runtime and one torch thread
    each (ONNX Runtime's spinning pools of one thread per core would make two workers slower
    than one), set in the environment so the CLIs and servers they start inherit it."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("SPECDEC_THREADS", "1")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        try:
            import torch

            torch.set_num_threads(1)
        except ImportError:
            pass


# The groups and modules that hold a worker longest (seconds of work on 2 cores: Ray ~350, EAGLE-3
# ~300, the feature drafter's ~170, the seq2seq families' single tests of up to 60, ...), handed
# out first: xdist gives a free worker the next unit in collection order, so a long one collected
# last would run alone at the end while the other worker idles (1465 s against 1218 s here).
# Longest first, the short tests fill in beside them.
LONGEST_FIRST = {name: rank for rank, name in enumerate(
    ("ray", "eagle3", "test_feature_drafter", "test_seq2seq_families", "test_seq2seq_export", "test_distill", "test_longrope", "test_demo"))}


def group_of(item) -> str | None:
    marker = item.get_closest_marker("xdist_group")
    return (marker.args[0] if marker.args else marker.kwargs.get("name")) if marker else None


def longest_first(item) -> int:
    """The rank of the item's group, else of its module (a module's tests spread over workers)."""
    rank = LONGEST_FIRST.get(group_of(item))
    module = getattr(getattr(item, "module", None), "__name__", "")  # a non-Python item has none
    return rank if rank is not None else LONGEST_FIRST.get(module.rpartition(".")[2], len(LONGEST_FIRST))


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly on machines without CUDA (CI never has one). Under ``--dist
    loadgroup``, the tests that use a module-scoped fixture (an export, a server, a Ray cluster
    of that module) run on one worker, so that fixture is made once."""
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        if any(d[-1].scope in ("module", "class") for d in defs.values()) and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    items.sort(key=longest_first)  # stable: the order within a group or module is kept
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


def pytest_collection_finish(session):
    """Each xdist worker exports its share of the shared bundles before any test runs
    (tests/bundles.py); their time is reported with the fixtures'."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker or session.config.option.collectonly:
        return
    try:
        import torch  # noqa: F401
    except ImportError:
        return
    from bundles import cache_root, prebuild, quiet

    factory = session.config._tmp_path_factory
    with quiet(cache_root(factory) / f"prebuild-{worker}.log"):  # outside any test's capture: keep the exporters' chatter off the terminal
        done = prebuild(factory, session.items, int(worker.removeprefix("gw")), int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    clock = session.config.pluginmanager.get_plugin("specdec-fixture-clock")
    if clock is not None:
        clock.pending += done


@pytest.fixture(scope="session")
def llama_bundle(tmp_path_factory):
    """A llama target/draft pair on disk and its exported bundle (γ = 4, max-seq-len 128), with
    an n-gram table counted from the tokenizer's corpus (a folder with one text file)."""
    pytest.importorskip("torch")
    from bundles import cached

    folder = cached(tmp_path_factory, "llama")
    return folder / "llama-target", folder / "llama-draft", folder / "bundle"


@pytest.fixture(scope="session")
def chat_bundle(tmp_path_factory):
    """A llama pair whose tokenizer has a chat template, exported with γ = 4, max-seq-len 512
    and batched graphs for 2 and 4 rows; the draft is a noisy copy (accepts and rejects)."""
    pytest.importorskip("torch")
    from bundles import cached

    folder = cached(tmp_path_factory, "chat")
    return folder / "llama-target", folder / "bundle"


FAMILIES = ["llama", "qwen2", "qwen3", "phi3", "gemma3", "gemma2", "mistral", "gpt2", "opt", "gpt_neox"]


@pytest.fixture(scope="session", params=FAMILIES)
def family_bundle(request, tmp_path_factory):
    """Per family: a target, a near draft (a noisy copy, so decoding accepts and rejects), and
    their bundle (γ = 4, max-seq-len 192, batched graphs: 4 rows for llama, 2 for the others;
    bundles._family says why). Shared by the export and runtime tests. The llama bundle also has
    an 8-node tree verify graph (the tree drafters' tests decode with it) and fused draft graphs
    (--fused-draft), so
    its decoding tests run the fused path at γ = 4 (and the step path at other γ); the other
    families' fused graphs are checked graph by graph (tests/export/test_fused.py), which keeps
    ~2 minutes of export per family out of the suite."""
    pytest.importorskip("torch")
    from bundles import cached, returned

    folder = cached(tmp_path_factory, "family", request.param)
    return request.param, folder / f"{request.param}-target", folder / f"{request.param}-draft", folder / "bundle", returned(folder)


@pytest.fixture(scope="session", params=["t5", "bart", "marian"])
def seq2seq_bundle(request, tmp_path_factory):
    """Per encoder-decoder family: a target, a near draft (a noisy copy with its own encoder) and
    their bundle (γ = 4, max-seq-len 160, max-source-len 64)."""
    pytest.importorskip("torch")
    from bundles import cached, returned

    folder = cached(tmp_path_factory, "seq2seq", request.param)
    return request.param, folder / f"{request.param}-target", folder / f"{request.param}-draft", folder / "bundle", returned(folder)


@pytest.fixture
def fetch_cache(tmp_path, monkeypatch):
    """specdec's cache (stored bundles fetched, digests) in this test's own folder."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def s3():
    """An S3-compatible server; its address and test credentials in this process's environment
    (children inherit it), restored at the end. Yields a boto3 client."""
    pytest.importorskip("s3fs")
    boto3 = pytest.importorskip("boto3")
    moto_server = pytest.importorskip("moto.server")
    from bundles import environ
    from specdec.serve.server import free_port

    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    env = dict(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    try:
        with environ(env):
            client = boto3.client("s3")
            client.create_bucket(Bucket="models")
            yield client
    finally:
        server.stop()

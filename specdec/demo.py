"""The embedded demo pair: where it lives, and its bundle, exported once and cached.

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


def cache_root() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def fingerprint(models: Path) -> str:
    """sha256 over the target's and draft's files (names and bytes), 12 hex digits."""
    h = hashlib.sha256()
    for role in ("target", "draft"):
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
    try:
        from specdec.export.pipeline import ExportConfig, Progress, export_bundle
    except ImportError as e:
        raise ModelError(
            f"the first run exports the demo pair, which needs the export extra ({e.name} is missing): "
            "pip install torch==2.13.0 -e '.[export]'"
        ) from None
    export_bundle(
        ExportConfig(str(models / "target"), str(models / "draft"), out, gamma=DEMO_GAMMA), Progress(report)
    )
    return out, True

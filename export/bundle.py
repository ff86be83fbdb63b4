"""Writing a bundle atomically: nothing that looks complete exists until validation passed.

Export builds everything in a hidden temporary folder beside the destination (same
filesystem, so the final move is a rename). The manifest is written last, with the size and
digest of every other file. On any failure the temporary folder is removed and an existing
bundle is left untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from specdec import integrity
from specdec.errors import ExportError
from specdec.manifest import MANIFEST_NAME, Manifest


def check_destination(out: Path, overwrite: bool) -> None:
    """Refuse an existing destination unless ``overwrite``; refuse a file in its place always."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; pass a folder path for the bundle")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"--out {out} already exists; pass --overwrite to replace it or choose another folder")


@contextlib.contextmanager
def staging(out: Path) -> Iterator[Path]:
    """A temporary folder beside ``out``; removed on exit unless it was moved into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the bundle should not be
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def commit(tmp: Path, out: Path, manifest: Manifest) -> Manifest:
    """Hash every file in ``tmp`` into the manifest (specdec/integrity.py), write it, and move
    ``tmp`` to ``out``, replacing any old bundle; returns the manifest as written."""
    # the export log is for reading: a bundle loads without it
    manifest = dataclasses.replace(manifest, integrity=integrity.record(tmp, skip=(MANIFEST_NAME, *([manifest.export_log] if manifest.export_log else []))))
    (tmp / MANIFEST_NAME).write_text(manifest.to_json())
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{tmp.name[-8:]}"
        out.rename(old)
    try:
        tmp.rename(out)
    except OSError:
        if old is not None:
            old.rename(out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return manifest

"""Bundles in object storage: ``specdec push BUNDLE URI`` and a local, verified cache for serving.

    s3://bucket/prefix/bundle   (s3fs; an S3-compatible server through AWS_ENDPOINT_URL)
    gs://bucket/prefix/bundle   (gcsfs: specdec[gcs]; an emulator through STORAGE_EMULATOR_HOST)
    az://container/prefix/bundle (adlfs: specdec[azure]; credentials as adlfs reads them, e.g.
                                AZURE_STORAGE_CONNECTION_STRING)
    https://host/path/bundle    (read only: the files the manifest names are fetched one by one)
    file:///path/bundle

A stored bundle is the exported folder, file for file (but ``export.log``, which stays with the
export). ``fetch`` reads its ``manifest.json`` first: the manifest's integrity table names every
other file with its size and digest, so nothing is listed and nothing unnamed is fetched. The local copy lives in
``<cache>/bundles/<sha256 of the manifest>``:

- once per node: a file lock makes concurrent fetches (replicas of one node) wait for the first;
- whole or absent: files are fetched into ``<key>.partial``, each to ``<file>.part`` first, and
  the folder is renamed into place only when every file matches the manifest;
- resumable: an interrupted fetch keeps the files it finished and the bytes of the one it was
  on; the next one continues from there (a ranged read);
- verified: each file's size and digest are checked as it lands; an object that differs is
  refused by name.

``push`` checks the bundle (every digest) before uploading, and writes ``manifest.json`` last, so
a store never holds a manifest whose files are not all there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from specdec import integrity
from specdec.errors import BundleError, ConfigError

log = logging.getLogger("specdec.store")

MANIFEST = "manifest.json"
SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "http", "https", "file", "memory")
CHUNK = 8 << 20  # bytes per read from the store


def is_uri(text: str | os.PathLike) -> bool:
    """Whether ``text`` names a stored bundle (``scheme://…``) rather than a local folder."""
    scheme, sep, _ = str(text).partition("://")
    return bool(sep) and scheme.lower() in SCHEMES


def local(bundle: str | os.PathLike) -> Path:
    """``bundle`` as a folder on this machine: a stored bundle's URI is fetched (``fetch``), a
    path is taken as it is. What every loader of a bundle calls."""
    return fetch(str(bundle)) if is_uri(bundle) else Path(bundle)


def name_of(uri: str) -> str:
    """The last part of a stored bundle's URI (its default model name, its folder name)."""
    return uri.rstrip("/").rsplit("/", 1)[-1]


def _fs(uri: str) -> tuple[Any, str]:
    """(fsspec filesystem, path within it) for ``uri``; a one-line error when its driver is missing."""
    try:
        import fsspec
    except ImportError:
        raise ConfigError(f"{uri}: bundles in object storage need the store extra: pip install 'specdec[store]'") from None
    try:
        fs, path = fsspec.core.url_to_fs(uri, skip_instance_cache=True)  # credentials and endpoints as they are now
    except (ImportError, ValueError) as e:
        raise ConfigError(f"{uri}: no driver for this scheme ({e}); for s3:// pip install 'specdec[store]', "
                          "for gs:// pip install 'specdec[gcs]', for az:// pip install 'specdec[azure]'") from None  # fmt: skip
    return fs, path.rstrip("/")


def _join(path: str, rel: str) -> str:
    return f"{path}/{rel}" if path else rel


def _read_manifest(fs, path: str, uri: str) -> bytes:
    try:
        with fs.open(_join(path, MANIFEST), "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise BundleError(f"{uri}/{MANIFEST} does not exist: no bundle is stored there; push one with specdec push BUNDLE {uri}") from None
    except (OSError, PermissionError) as e:
        raise BundleError(f"{uri}/{MANIFEST} cannot be read ({e}); check the URI and the store's credentials") from None


def _table(raw: bytes, uri: str) -> dict[str, Any]:
    try:
        manifest = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{uri}/{MANIFEST} is not valid JSON ({e}); push the bundle again") from None
    if not isinstance(manifest, dict) or "integrity" not in manifest:
        raise BundleError(f"{uri}/{MANIFEST} has no integrity table (an older specdec's bundle); re-export it, then push it again")
    table = integrity.check_table(manifest["integrity"])
    for rel in table["files"]:
        if rel.startswith("/") or ".." in Path(rel).parts:
            raise BundleError(f"{uri}/{MANIFEST} names {rel!r}, a path outside the bundle; push a bundle specdec-export wrote")
    return table


def stored(uri: str) -> bool:
    """Whether a bundle's manifest is at ``uri`` (a whole push: the manifest goes last)."""
    fs, path = _fs(uri)
    return fs.exists(_join(path, MANIFEST))


def cache_dir(manifest: bytes) -> Path:
    """Where the bundle whose manifest is ``manifest`` is kept locally."""
    return integrity.cache_root() / "bundles" / hashlib.sha256(manifest).hexdigest()[:32]


def fetch(uri: str, progress: bool = True) -> Path:
    """The local copy of the bundle stored at ``uri``, fetched now if this node has none (see
    the module docstring); a ``BundleError`` names a missing or altered object."""
    return fetch_counted(uri, progress)[0]


def fetch_counted(uri: str, progress: bool = True) -> tuple[Path, int]:
    """``fetch``, and the bytes this call read from the store for the bundle's files (0: cached)."""
    uri = uri.rstrip("/")
    fs, path = _fs(uri)
    from filelock import FileLock

    raw = _read_manifest(fs, path, uri)
    table = _table(raw, uri)
    final = cache_dir(raw)
    if (final / MANIFEST).is_file():
        return final, 0
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):
        if (final / MANIFEST).is_file():  # another process of this node fetched it meanwhile
            return final, 0
        partial = final.with_name(final.name + ".partial")
        n = _fetch_files(fs, path, uri, table, partial, progress)
        (partial / MANIFEST).write_bytes(raw)
        os.replace(partial, final)
    log.info("specdec: fetched %s (%.1f MB) into %s", uri, n / 1e6, final)
    return final, n


def _fetch_files(fs, path: str, uri: str, table: dict[str, Any], partial: Path, progress: bool) -> int:
    from tqdm.auto import tqdm

    files = table["files"]
    todo = {rel: e for rel, e in files.items() if not _whole(partial / rel, e, table["algorithm"])}
    total = sum(e["size"] for e in todo.values())
    fetched = 0
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"fetching {uri.rsplit('/', 1)[-1]}", disable=not progress or not todo) as bar:
        for rel, e in todo.items():
            dest = partial / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            part = dest.with_name(dest.name + ".part")
            have = part.stat().st_size if part.is_file() else 0
            if have > e["size"]:
                part.unlink()
                have = 0
            bar.update(have)
            try:
                with fs.open(_join(path, rel), "rb") as src, open(part, "ab") as out:
                    if have:
                        src.seek(have)  # resume: a ranged read from where the last fetch stopped
                    while block := src.read(min(CHUNK, e["size"] - have + 1)):
                        out.write(block)
                        have += len(block)
                        fetched += len(block)
                        bar.update(len(block))
            except FileNotFoundError:
                raise BundleError(f"{uri}/{rel} does not exist, and the bundle's manifest names it: the stored bundle is incomplete; push it again") from None
            _check(part, rel, e, table["algorithm"], uri)
            os.replace(part, dest)
    return fetched


def _whole(path: Path, e: dict, algorithm: str) -> bool:
    """Whether a file a previous fetch finished is there and matches."""
    return path.is_file() and path.stat().st_size == e["size"] and integrity.digest(path, algorithm) == e["digest"]


def _check(part: Path, rel: str, e: dict, algorithm: str, uri: str) -> None:
    size = part.stat().st_size
    problem = f"is {size} bytes, the manifest says {e['size']}" if size != e["size"] else None
    if problem is None:
        got = integrity.digest(part, algorithm)
        problem = f"has {algorithm} {got[:12]}…, the manifest says {e['digest'][:12]}…" if got != e["digest"] else None
    if problem:
        part.unlink()
        raise BundleError(f"{uri}/{rel} {problem}: the stored object differs from the bundle that was pushed; push the bundle again")


def push(bundle: Path, uri: str, progress: bool = True) -> int:
    """Upload ``bundle`` to ``uri`` after checking every file against its manifest; the manifest
    goes last. Returns the bytes uploaded."""
    from tqdm.auto import tqdm

    from specdec.manifest import load_manifest

    bundle, uri = Path(bundle), uri.rstrip("/")
    load_manifest(bundle, "full", stamps=False)  # refuses a bundle that is incomplete or changed
    raw = (bundle / MANIFEST).read_bytes()
    table = _table(raw, str(bundle))
    fs, path = _fs(uri)
    total = sum(e["size"] for e in table["files"].values())
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"pushing {bundle.name}", disable=not progress) as bar:
        for parent in sorted({_join(path, rel).rpartition("/")[0] for rel in table["files"]} - {""}):
            fs.makedirs(parent, exist_ok=True)  # a local or mounted store needs its folders; object stores have none to make
        for rel, e in table["files"].items():
            with open(bundle / rel, "rb") as src, fs.open(_join(path, rel), "wb") as out:
                shutil.copyfileobj(src, out, CHUNK)
            bar.update(e["size"])
        with fs.open(_join(path, MANIFEST), "wb") as out:
            out.write(raw)
    return total + len(raw)

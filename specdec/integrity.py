"""Bundle integrity: each file's size and digest, recorded at export and checked at load.

Export hashes every file of the finished bundle but ``manifest.json`` (graphs, ``*.weights``,
tokenizer files, chat template, n-gram table, any drafter head) into the manifest's table:

    "integrity": {"algorithm": "blake3", "files": {"target.weights": {"size": 61203456, "digest": "ab12…"}, …}}

Load checks it in one of two modes:

    "full"  every file's size, then its digest (the default). A file this user verified before and
            whose (path, size, mtime_ns, ctime_ns, inode, device) is unchanged is not hashed again
            (``Stamps``, a cache file outside the bundle).
    "size"  sizes only: a truncated or half-copied file is refused, a flipped byte is NOT.

Cost (tools/bench_load.py, docs/bench/integrity/results.json): here BLAKE3 reads ~3.2 GB/s on one
core against ~1.4 GB/s for hashlib's sha256 (with SHA-NI), so a 16 GB fp16 8B model costs ~5 s
on its first load and ~0 on later ones; BLAKE3 also splits one large file over the cores.
Bundles of older specdec have no table: their graphs and n-gram table carry a sha256 each, which
load still checks (``Expected`` with ``size=None``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from specdec.atomic import write_atomic
from specdec.errors import BundleError

log = logging.getLogger("specdec.integrity")

DEFAULT_ALGORITHM = "blake3"
MODES = ("full", "size")
BLOCK = 16 << 20  # bytes read per update; BLAKE3 splits a block this size over its threads
WORKERS = min(8, os.cpu_count() or 1)  # files hashed at once (hashlib and blake3 release the GIL)
RACY_NS = 2_000_000_000  # a file changed this recently is not stamped: a write within the same
# timestamp tick (2 s on FAT, ~ms on ext4) would leave size and times as they were ("racy git")
MAX_STAMPS = 1024  # entries kept in the stamp file, newest last (a few bundles of ~20 files each)
STAMP_FILE = "verified.json"


def _blake3() -> Any:
    try:
        import blake3
    except ImportError:
        raise BundleError("this bundle's files are hashed with BLAKE3 and the blake3 package is missing: pip install blake3") from None
    return blake3.blake3(max_threads=blake3.blake3.AUTO)


ALGORITHMS: dict[str, Callable[[], Any]] = {"blake3": _blake3, "sha256": hashlib.sha256}  # name -> new hasher


def digest(path: Path, algorithm: str) -> str:
    """The hex digest of the file at ``path``."""
    h = ALGORITHMS[algorithm]()
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def record(folder: Path, skip: tuple[str, ...] = (), algorithm: str = DEFAULT_ALGORITHM) -> dict[str, Any]:
    """The integrity table of every file under ``folder`` but the relative paths in ``skip``."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).as_posix() not in skip)
    with ThreadPoolExecutor(WORKERS) as pool:
        digests = list(pool.map(lambda p: digest(p, algorithm), files))
    table = {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "digest": d} for p, d in zip(files, digests)}
    return {"algorithm": algorithm, "files": table}


def check_table(raw: Any) -> dict[str, Any]:
    """``raw`` (a manifest's "integrity" entry) if well-formed; a ``BundleError`` saying what is wrong."""
    bad = "manifest's integrity table is malformed ({}); re-export the bundle with specdec-export"
    if not isinstance(raw, dict) or not isinstance(raw.get("files"), dict):
        raise BundleError(bad.format("expected {'algorithm': NAME, 'files': {path: {'size', 'digest'}}}"))
    if raw.get("algorithm") not in ALGORITHMS:
        raise BundleError(f"bundle files are hashed with {raw.get('algorithm')!r}; this specdec knows {', '.join(ALGORITHMS)}: "
                          "upgrade specdec or re-export the bundle")  # fmt: skip
    for rel, e in raw["files"].items():
        if not (isinstance(e, dict) and type(e.get("size")) is int and isinstance(e.get("digest"), str)):
            raise BundleError(bad.format(f"entry {rel!r} is {str(e)[:60]}"))
    return raw


@dataclass(frozen=True)
class Expected:
    """One bundle file as the manifest records it."""

    path: Path  # resolved, inside the bundle
    rel: str  # as the manifest names it
    what: str  # for messages: "graph target_verify", "target weights", "tokenizer file", ...
    size: int | None  # None: an older bundle recorded no size
    algorithm: str
    digest: str


def check(expected: list[Expected], mode: str = "full", stamps: Stamps | None = None) -> None:
    """Refuse (``BundleError``) a missing file, a size that differs, and in "full" mode a digest
    that differs; files in ``stamps`` are not hashed again, files hashed now are added to it."""
    if mode not in MODES:
        raise BundleError(f"verify={mode!r}: expected one of {', '.join(MODES)}")
    stats = {}
    for e in expected:
        try:
            stats[e.rel] = st = e.path.stat()
        except OSError:
            raise BundleError(f"bundle file {e.rel!r} ({e.what}) is missing or unreadable; re-export the bundle or copy it again") from None
        if e.size is not None and st.st_size != e.size:
            raise BundleError(f"bundle file {e.rel!r} ({e.what}) is {st.st_size} bytes, the manifest says {e.size}: the bundle is corrupt "
                              "or was partly copied; re-export it or copy it again")  # fmt: skip
    if mode == "size":
        return
    todo = [e for e in expected if stamps is None or not stamps.valid(e, stats[e.rel])]
    if not todo:
        return
    start = time.time_ns()
    with ThreadPoolExecutor(WORKERS) as pool:
        got = list(pool.map(_digest, todo))
    bad = [f"{e.rel!r} ({e.what}) has {e.algorithm} {d[:12]}…, the manifest says {e.digest[:12]}…" for e, d in zip(todo, got) if d != e.digest]
    if bad:
        raise BundleError(f"bundle file {'; '.join(bad)}: the bundle is corrupt (changed since export); re-export it or copy it again")
    if stamps is not None:
        for e in todo:
            stamps.add(e, stats[e.rel], start)
        stamps.save()


def _digest(e: Expected) -> str:
    try:
        return digest(e.path, e.algorithm)
    except OSError as err:
        raise BundleError(f"bundle file {e.rel!r} ({e.what}) cannot be read ({err.strerror or err}); check its permissions or copy the bundle again") from None


def cache_root() -> Path:
    """``$SPECDEC_CACHE``, else ``$XDG_CACHE_HOME/specdec``, else ``~/.cache/specdec``."""
    if os.environ.get("SPECDEC_CACHE"):
        return Path(os.environ["SPECDEC_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdec"


class Stamps:
    """Files this user verified, keyed by resolved path: a later load skips hashing a file whose
    size, mtime_ns, ctime_ns, inode and device are unchanged and whose recorded digest is the one
    the manifest expects. Any write changes mtime and ctime, and ctime cannot be set back.

    Kept in ``cache_root()/verified.json``, never in the bundle (it may be read-only). Risk: bytes
    that rot on disk without a write are not seen until ``specdec inspect`` (which ignores stamps)
    hashes again; whoever can write this user's cache can vouch for a file. An unreadable or
    unwritable stamp file only costs hashing."""

    def __init__(self, path: Path | None = None):
        self.path = path or cache_root() / STAMP_FILE
        self.entries: dict[str, list] = {}
        self.changed = False
        try:
            raw = json.loads(self.path.read_text())
            if isinstance(raw, dict) and raw.get("version") == 1 and isinstance(raw.get("files"), dict):
                self.entries = raw["files"]
        except (OSError, ValueError):
            pass

    @staticmethod
    def _key(e: Expected, st: os.stat_result) -> list:
        return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev, f"{e.algorithm}:{e.digest}"]

    def valid(self, e: Expected, st: os.stat_result) -> bool:
        return self.entries.get(str(e.path)) == self._key(e, st)

    def add(self, e: Expected, st: os.stat_result, start_ns: int) -> None:
        """Stamp ``e`` (verified with stat ``st``, hashing begun at ``start_ns``) unless it changed too recently."""
        if start_ns - max(st.st_mtime_ns, st.st_ctime_ns) < RACY_NS:
            return
        self.entries.pop(str(e.path), None)  # re-inserted last: the oldest entries go first
        self.entries[str(e.path)] = self._key(e, st)
        self.changed = True

    def save(self) -> None:
        """Write the stamps atomically (a concurrent writer's entries may be lost: they are re-hashed)."""
        if not self.changed:
            return
        keep = {k: v for k, v in list(self.entries.items())[-MAX_STAMPS:] if os.path.exists(k)}  # deleted bundles go
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, lambda fh: fh.write(json.dumps({"version": 1, "files": keep}).encode()), unique=True)
            self.changed = False
        except OSError as e:
            log.debug("stamps not saved to %s: %s", self.path, e)

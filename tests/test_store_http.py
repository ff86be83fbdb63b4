"""Bundles served over HTTP(S) (specdec/store.py, read only): a plain static file server on a free
127.0.0.1 port, the way a bundle sits behind a CDN or an object store's public URL. Nothing is
listed: the manifest names every file, which is fetched by its own URL and checked."""

from __future__ import annotations

import functools
import json
import shutil
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")  # fsspec's HTTP driver

from specdec import store  # noqa: E402
from specdec.errors import BundleError  # noqa: E402
from specdec.runtime import SpeculativeDecoder  # noqa: E402


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # the test's output stays readable
        pass


@pytest.fixture
def served(tmp_path):
    """A static file server over ``tmp_path / "www"``; yields (root folder, base URL, requested paths)."""
    root = tmp_path / "www"
    root.mkdir()
    requested: list[str] = []

    class Handler(_Quiet):
        def do_GET(self):
            requested.append(self.path)
            super().do_GET()

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}", requested
    finally:
        server.shutdown()
        server.server_close()


def _publish(bundle: Path, root: Path, name: str) -> Path:
    """The bundle's travelling files (as ``specdec push`` writes them) under ``root / name``."""
    table = json.loads((bundle / "manifest.json").read_text())["integrity"]["files"]
    dst = root / name
    for rel in [*table, "manifest.json"]:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(bundle / rel, dst / rel)
    return dst


def test_a_bundle_over_http_is_fetched_by_its_manifest_and_decodes_the_same(llama_bundle, served, fetch_cache):
    root, base, requested = served
    bundle = Path(llama_bundle[2])
    _publish(bundle, root, "llama")
    local, n = store.fetch_counted(f"{base}/llama", progress=False)
    assert n > 0 and (local / "manifest.json").read_bytes() == (bundle / "manifest.json").read_bytes()
    table = json.loads((bundle / "manifest.json").read_text())["integrity"]["files"]
    assert {p.split("?")[0] for p in requested} <= {"/llama/manifest.json", *(f"/llama/{rel}" for rel in table)}  # nothing listed
    want = SpeculativeDecoder.load(bundle).generate([5, 9, 13, 2], max_new_tokens=12, ignore_eos=True).tokens
    assert SpeculativeDecoder.load(f"{base}/llama").generate([5, 9, 13, 2], max_new_tokens=12, ignore_eos=True).tokens == want
    assert store.fetch_counted(f"{base}/llama", progress=False) == (local, 0)  # cached: the manifest alone is read


def test_over_http_a_missing_bundle_or_an_altered_file_is_refused_by_name(llama_bundle, served, fetch_cache):
    root, base, _ = served
    with pytest.raises(BundleError, match="does not exist"):
        store.fetch(f"{base}/nothing-here", progress=False)
    dst = _publish(Path(llama_bundle[2]), root, "altered")
    table = json.loads((dst / "manifest.json").read_text())["integrity"]["files"]
    victim = max(table, key=lambda rel: table[rel]["size"])
    data = bytearray((dst / victim).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    (dst / victim).write_bytes(bytes(data))
    with pytest.raises(BundleError, match=victim):
        store.fetch(f"{base}/altered", progress=False)
    assert not list((fetch_cache / "bundles").glob("*/manifest.json"))  # no copy kept as whole

"""Bundles in Google Cloud Storage and Azure Blob Storage (specdec/store.py through gcsfs and
adlfs), each against a real server of that API on a free 127.0.0.1 port, reached the way its
driver reaches any emulator:

- gs://: gcp-storage-emulator (a pip package; ``STORAGE_EMULATOR_HOST``);
- az://: Azurite, Microsoft's emulator (an npm package: taken from PATH, else installed with npm
  into the tests' cache once, ~10 s; skipped where npm is missing or the install fails;
  ``AZURE_STORAGE_CONNECTION_STRING`` with Azurite's published development account).

The store code is the one s3:// runs (tests/test_store.py); these check that each driver's reads,
ranged reads, writes and missing objects behave as it needs."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from filelock import FileLock

from bundles import cache_root, environ, travelling_files

pytest.importorskip("fsspec")

from specdec import store  # noqa: E402
from specdec.errors import BundleError  # noqa: E402

# Azurite's well-known development account (https://learn.microsoft.com/azure/storage/common/storage-use-azurite)
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def azurite_blob(tmp_path_factory) -> str | None:
    """The azurite-blob command: on PATH, or npm-installed into the tests' cache (once per cache)."""
    if found := shutil.which("azurite-blob"):
        return found
    npm = shutil.which("npm")
    prefix = cache_root(tmp_path_factory) / "azurite"
    exe = prefix / "node_modules" / ".bin" / "azurite-blob"
    if npm is None:
        return None
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(prefix) + ".lock"):
        if not exe.exists():
            try:
                subprocess.run([npm, "install", "--prefix", str(prefix), "azurite@3", "--no-audit", "--no-fund", "--loglevel", "error"],
                               capture_output=True, timeout=240, check=False)  # fmt: skip
            except subprocess.TimeoutExpired:
                return None
    return str(exe) if exe.exists() else None


def _start(cmd: list[str], port: int, log: Path, what: str) -> subprocess.Popen:
    """``cmd`` as a child process, returned once it accepts connections on ``port`` (bounded)."""
    with open(log, "wb") as out:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return server
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                _stop(server)
                pytest.fail(f"{what} did not start: {log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.1)


def _stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait(10)


@pytest.fixture(scope="module", params=["gs", "az"])
def cloud(request, tmp_path_factory):
    """(scheme, fsspec filesystem) of a running emulator with a "models" bucket/container; its
    address in this process's environment (children inherit it), restored at the end."""
    import fsspec

    from specdec.serve.server import free_port

    scheme, port = request.param, free_port()
    log = tmp_path_factory.mktemp(scheme) / "emulator.log"
    if scheme == "gs":
        pytest.importorskip("gcsfs")
        pytest.importorskip("gcp_storage_emulator")
        env = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}"}
        cmd = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory",
               "--default-bucket", "models", "--quiet"]  # fmt: skip
    else:
        pytest.importorskip("adlfs")
        exe = azurite_blob(tmp_path_factory)
        if exe is None:
            pytest.skip("Azurite is not installed and npm could not install it (npm install -g azurite)")
        env = {"AZURE_STORAGE_CONNECTION_STRING": f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
                                                  f"BlobEndpoint=http://127.0.0.1:{port}/{AZURITE_ACCOUNT};"}  # fmt: skip
        cmd = [exe, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence", "--silent", "--disableTelemetry",
               "--skipApiVersionCheck"]  # fmt: skip
    server = _start(cmd, port, log, f"the {scheme}:// emulator")
    try:
        with environ(env):
            fs = fsspec.filesystem(scheme, skip_instance_cache=True)
            if scheme == "az":
                fs.mkdir("models")  # a container; the gs emulator made its bucket
            yield scheme, fs
    finally:
        _stop(server)


def test_push_fetch_resume_and_load(cloud, llama_bundle, fetch_cache):
    """Pushed once; fetched into the node's cache once (the second fetch reads the manifest
    alone); an interrupted fetch continues with a ranged read from its last byte; the decoder
    loaded from the URI gives the bundle's tokens."""
    scheme, _ = cloud
    _, _, bundle = llama_bundle
    uri = f"{scheme}://models/llama/v1"
    sent = store.push(bundle, uri, progress=False)
    assert sent == sum(len(b) for b in travelling_files(bundle).values()) and store.stored(uri)
    raw = (bundle / "manifest.json").read_bytes()
    table = json.loads(raw)["integrity"]["files"]
    big = max(table, key=lambda r: table[r]["size"])
    final = store.cache_dir(raw)
    head = table[big]["size"] // 3
    part = final.with_name(final.name + ".partial") / (big + ".part")
    part.parent.mkdir(parents=True, exist_ok=True)
    part.write_bytes((bundle / big).read_bytes()[:head])  # a fetch cut off mid-file
    local, n = store.fetch_counted(uri, progress=False)
    assert travelling_files(local) == travelling_files(bundle) and n == sum(e["size"] for e in table.values()) - head
    assert store.fetch_counted(uri + "/", progress=False) == (local, 0)

    from specdec.runtime import SpeculativeDecoder

    want = SpeculativeDecoder.load(bundle).generate([5, 6, 7], max_new_tokens=12, ignore_eos=True).tokens
    assert SpeculativeDecoder.load(uri).generate([5, 6, 7], max_new_tokens=12, ignore_eos=True).tokens == want


def test_a_changed_or_missing_object_is_refused_by_name(cloud, llama_bundle, fetch_cache):
    scheme, fs = cloud
    _, _, bundle = llama_bundle
    uri = f"{scheme}://models/llama/tampered"
    store.push(bundle, uri, progress=False)
    table = json.loads((bundle / "manifest.json").read_text())["integrity"]["files"]
    rel = next(r for r in table if r.endswith(".weights"))
    body = bytearray((bundle / rel).read_bytes())
    body[len(body) // 2] ^= 0xFF  # one flipped byte, same size
    fs.pipe(f"models/llama/tampered/{rel}", bytes(body))
    with pytest.raises(BundleError, match=f"{uri}/{rel} has blake3 .* the manifest says") as e:
        store.fetch(uri, progress=False)
    assert "\n" not in str(e.value)
    assert not [p for p in (fetch_cache / "bundles").iterdir() if p.is_dir() and not p.name.endswith(".partial")]  # nothing took its place
    fs.rm(f"models/llama/tampered/{rel}")
    with pytest.raises(BundleError, match=f"{uri}/{rel} does not exist, and the bundle's manifest names it"):
        store.fetch(uri, progress=False)
    with pytest.raises(BundleError, match=f"{scheme}://models/nothing/manifest.json does not exist: no bundle is stored there"):
        store.fetch(f"{scheme}://models/nothing", progress=False)

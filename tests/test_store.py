"""Bundles in object storage (specdec/store.py) against a real S3-compatible server: moto's
server mode on a free 127.0.0.1 port (the ``s3`` fixture), reached through s3fs as a user's
store would be."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bundles import travelling_files

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from specdec import store  # noqa: E402
from specdec.errors import BundleError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_push_then_fetch_gives_the_same_bundle_once(s3, llama_bundle, fetch_cache):
    _, _, bundle = llama_bundle
    uri = "s3://models/llama/v1"
    sent = store.push(bundle, uri, progress=False)
    assert sent == sum(len(b) for b in travelling_files(bundle).values())
    local, n = store.fetch_counted(uri, progress=False)
    assert travelling_files(local) == travelling_files(bundle) and n == sent - (bundle / "manifest.json").stat().st_size
    assert sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()) == sorted(travelling_files(bundle))  # nothing else
    assert local.parent == fetch_cache / "bundles" and not list(fetch_cache.glob("bundles/*.partial"))
    again, n = store.fetch_counted(uri + "/", progress=False)  # cached: nothing read but the manifest
    assert again == local and n == 0

    from specdec.runtime import SpeculativeDecoder

    want = SpeculativeDecoder.load(bundle).generate([5, 6, 7], max_new_tokens=12, ignore_eos=True).tokens
    assert SpeculativeDecoder.load(uri).generate([5, 6, 7], max_new_tokens=12, ignore_eos=True).tokens == want


def test_concurrent_fetches_on_one_node_download_once(s3, llama_bundle, fetch_cache):
    """Two processes (two replicas of one node) fetch at once: one downloads, the other waits
    for it and reads nothing."""
    _, _, bundle = llama_bundle
    uri = "s3://models/llama/concurrent"
    store.push(bundle, uri, progress=False)
    code = f"from specdec.store import fetch_counted; p, n = fetch_counted({uri!r}, progress=False); print(n, p)"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=dict(os.environ)) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    counts = sorted(int(o[0]) for o in outs)
    assert counts[0] == 0 and counts[1] > 0 and outs[0][1] == outs[1][1], outs


def test_an_interrupted_fetch_resumes(s3, llama_bundle, fetch_cache):
    """Files a fetch finished are kept, and the one it was on continues from its last byte."""
    _, _, bundle = llama_bundle
    uri = "s3://models/llama/resume"
    store.push(bundle, uri, progress=False)
    raw = (bundle / "manifest.json").read_bytes()
    table = json.loads(raw)["integrity"]["files"]
    big, small = sorted(table, key=lambda r: -table[r]["size"])[:2]
    partial = store.cache_dir(raw).with_name(store.cache_dir(raw).name + ".partial")
    (partial / small).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(bundle / small, partial / small)  # finished before the interruption
    head = table[big]["size"] // 3
    (partial / big).parent.mkdir(parents=True, exist_ok=True)
    (partial / (big + ".part")).write_bytes((bundle / big).read_bytes()[:head])  # cut off mid-file
    local, n = store.fetch_counted(uri, progress=False)
    assert n == sum(e["size"] for e in table.values()) - table[small]["size"] - head
    assert travelling_files(local) == travelling_files(bundle)


def test_a_changed_or_missing_object_is_refused_by_name(s3, llama_bundle, fetch_cache):
    _, _, bundle = llama_bundle
    uri = "s3://models/llama/tampered"
    store.push(bundle, uri, progress=False)
    table = json.loads((bundle / "manifest.json").read_text())["integrity"]["files"]
    rel = next(r for r in table if r.endswith(".weights"))
    body = bytearray((bundle / rel).read_bytes())
    body[len(body) // 2] ^= 0xFF  # one flipped byte, same size
    s3.put_object(Bucket="models", Key=f"llama/tampered/{rel}", Body=bytes(body))
    with pytest.raises(BundleError, match=f"{uri}/{rel} has blake3 .* the manifest says") as e:
        store.fetch(uri, progress=False)
    assert "\n" not in str(e.value)
    assert not [p for p in (fetch_cache / "bundles").iterdir() if not p.name.endswith((".partial", ".lock"))]  # no bundle took its place
    s3.delete_object(Bucket="models", Key=f"llama/tampered/{rel}")
    with pytest.raises(BundleError, match=f"{uri}/{rel} does not exist, and the bundle's manifest names it"):
        store.fetch(uri, progress=False)
    with pytest.raises(BundleError, match="s3://models/nothing/manifest.json does not exist: no bundle is stored there"):
        store.fetch("s3://models/nothing", progress=False)


def test_push_refuses_a_changed_bundle_and_uploads_nothing(s3, llama_bundle, tmp_path):
    _, _, bundle = llama_bundle
    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    w = next(copy.glob("*.weights"))
    body = bytearray(w.read_bytes())
    body[7] ^= 1
    w.write_bytes(bytes(body))
    with pytest.raises(BundleError, match=w.name):
        store.push(copy, "s3://models/changed", progress=False)
    assert s3.list_objects_v2(Bucket="models", Prefix="changed/").get("KeyCount", 0) == 0


def test_cli_push_and_a_bad_uri(s3, llama_bundle, fetch_cache):
    _, _, bundle = llama_bundle
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-m", "specdec", "push", str(bundle), "s3://models/cli"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and "serve it with: specdec serve s3://models/cli" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-m", "specdec", "push", str(bundle), "models/cli"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and "expected a stored location such as s3://" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert store.is_uri("s3://a/b") and store.is_uri("file:///tmp/x") and not store.is_uri("bundles/x") and not store.is_uri("C:/x")
    r = subprocess.run([sys.executable, "-m", "specdec", "inspect", "s3://models/cli"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and "target_verify" in r.stdout, r.stderr  # read-only commands take a URI too
    r = subprocess.run([sys.executable, "-m", "specdec", "inspect", "s3://models/none"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "s3://models/none/manifest.json does not exist" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    from specdec.runtime import BatchEngine

    engine = BatchEngine("s3://models/cli", max_batch=1)
    try:
        assert len(engine.generate_many([[5, 6, 7]], max_new_tokens=4, ignore_eos=True)[0].tokens) == 4
    finally:
        engine.close()
    # a scheme whose driver is not installed (import gcsfs fails, in a fresh process): exit 2, one line naming it
    no_driver = "import sys; sys.modules['gcsfs'] = None; from specdec.commands.cli.main import main; main()"
    r = subprocess.run([sys.executable, "-c", no_driver, "inspect", "gs://bucket/b"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "gs://bucket/b: no driver for this scheme" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_serve_from_the_store(s3, chat_bundle, fetch_cache):
    """``specdec serve s3://…``: fetched into the node's cache, then served; the model keeps the
    URI's name and greedy tokens are the bundle's."""
    import openai

    from specdec.runtime import SpeculativeDecoder
    from specdec.serve.process import ServerProcess

    uri = "s3://models/chat/tiny-chat"
    store.push(chat_bundle[1], uri, progress=False)
    want = SpeculativeDecoder.load(chat_bundle[1]).generate([5, 6, 7], max_new_tokens=16, ignore_eos=True).tokens
    with ServerProcess(uri, "--threads", "1", log=fetch_cache.parent / "serve.log", env=dict(os.environ)) as s:
        s.wait_ready(120)
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        assert [m.id for m in c.models.list().data] == ["tiny-chat"]
        r = c.completions.create(model="tiny-chat", prompt=[5, 6, 7], max_tokens=16, temperature=0,
                                 extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
        assert r.choices[0].model_extra["token_ids"] == want
        assert s.stop(60) == 0
    assert len([p for p in (fetch_cache / "bundles").iterdir() if p.is_dir() and not p.name.endswith(".partial")]) == 1


def test_a_local_store_by_file_uri(llama_bundle, fetch_cache, tmp_path):
    """file:// goes through the same code as s3:// (fsspec's local driver): push, fetch once, serve."""
    _, _, bundle = llama_bundle
    uri = f"file://{tmp_path / 'store' / 'llama'}"
    store.push(bundle, uri, progress=False)
    local, n = store.fetch_counted(uri, progress=False)
    assert travelling_files(local) == travelling_files(bundle) and n > 0 and store.fetch_counted(uri, progress=False) == (local, 0)


def test_export_straight_to_the_store(s3, llama_bundle, fetch_cache):
    """``specdec-export --out s3://…``: exported and validated locally, then pushed; an occupied
    prefix is refused before any work unless --overwrite."""
    target, draft, bundle = llama_bundle
    env = dict(os.environ)
    cmd = [sys.executable, "-c", "from specdec.commands.cli.main import export_main; export_main()", "--target", str(target), "--draft", str(draft),
           "--out", "s3://models/exported", "--max-seq-len", "64"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "pushed to s3://models/exported" in r.stdout, r.stderr[-2000:]
    from specdec.runtime import SpeculativeDecoder

    dec = SpeculativeDecoder.load("s3://models/exported")
    assert dec.manifest.max_seq_len == 64 and len(dec.generate([5, 6, 7], max_new_tokens=4, ignore_eos=True).tokens) == 4
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "a bundle is already stored there; pass --overwrite" in r.stderr, r.stderr[-2000:]


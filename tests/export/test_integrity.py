"""Every file a bundle loads is hashed at export and checked at load (specdec/integrity.py).

One byte flipped in each kind of file (graph, weights, tokenizer, chat template, n-gram table)
is refused with a ``BundleError`` naming the file; ``verify="size"`` lets a flipped byte
through but not a truncation; the verified-once stamp is dropped by any write; ``specdec
inspect`` hashes everything again; bundles of older specdec (graph hashes only) still load.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import warnings

import pytest

from specdec import integrity
from specdec.errors import BundleError
from specdec.manifest import MANIFEST_NAME, load_manifest

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Stamps go to this test's folder, never the user's cache."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def bundle(llama_bundle, tmp_path):
    """A copy of the llama bundle (graphs, weights, tokenizer, n-gram table) given a chat template
    the way export writes one (tokenizer/chat_template.jinja), its table recorded by export's code."""
    out = tmp_path / "bundle"
    shutil.copytree(llama_bundle[2], out)
    (out / "tokenizer" / "chat_template.jinja").write_text(TEMPLATE)
    edit(out, lambda m: m.update(chat_template="tokenizer/chat_template.jinja", integrity=integrity.record(out, skip=(MANIFEST_NAME,))))
    return out


def edit(bundle, fn) -> None:
    raw = json.loads((bundle / MANIFEST_NAME).read_text())
    fn(raw)
    (bundle / MANIFEST_NAME).write_text(json.dumps(raw))


def flip(path, keep_mtime: bool = False) -> None:
    """Flip the lowest bit of the middle byte of ``path`` (its size stays)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        b = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([b[0] ^ 1]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def counting(monkeypatch) -> list[str]:
    """The names of the files hashed from now on."""
    seen = []
    real = integrity.digest
    monkeypatch.setattr(integrity, "digest", lambda path, algorithm: seen.append(path.name) or real(path, algorithm))
    return seen


def test_export_records_every_file(llama_bundle):
    out = llama_bundle[2]
    m = load_manifest(out)
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} - {MANIFEST_NAME, m.export_log}  # the log is for reading
    assert m.export_log == "export.log" and (out / m.export_log).is_file()
    assert m.integrity["algorithm"] == "blake3" and set(m.integrity["files"]) == on_disk
    assert {"target.weights", "draft.weights", "tokenizer/tokenizer.json", "ngram.npz", "target_verify.onnx"} <= on_disk
    for rel, e in m.integrity["files"].items():
        assert e["size"] == (out / rel).stat().st_size and e["digest"] == integrity.digest(out / rel, "blake3"), rel


KINDS = {"graph": "draft_step.onnx", "target weights": "target.weights", "draft weights": "draft.weights",
         "tokenizer": "tokenizer/tokenizer.json", "chat template": "tokenizer/chat_template.jinja", "n-gram table": "ngram.npz"}  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_one_flipped_byte_is_refused_naming_the_file(bundle, kind):
    rel = KINDS[kind]
    load_manifest(bundle)  # intact: loads
    flip(bundle / rel)
    with pytest.raises(BundleError) as err:
        load_manifest(bundle)
    msg = str(err.value)
    assert repr(rel) in msg and kind in msg and "blake3" in msg and "re-export" in msg and "\n" not in msg, msg
    load_manifest(bundle, verify="size")  # the opt-out does not look at bytes


def test_size_mode_refuses_a_truncated_file(bundle):
    with open(bundle / "target.weights", "r+b") as f:
        f.truncate(f.seek(0, 2) - 1)
    for verify in ("size", "full"):
        with pytest.raises(BundleError, match=r"'target.weights' \(target weights\) is \d+ bytes, the manifest says \d+"):
            load_manifest(bundle, verify=verify)
    with pytest.raises(BundleError, match="verify='fast'"):
        load_manifest(bundle, verify="fast")


def test_stamp_skips_rehashing_until_a_write(bundle, monkeypatch, tmp_path):
    monkeypatch.setattr(integrity, "RACY_NS", 200_000_000)
    files = len(load_manifest(bundle, verify="size").integrity["files"])
    seen = counting(monkeypatch)
    load_manifest(bundle)  # the copy is seconds old at most: too recent to stamp
    assert len(seen) == files
    time.sleep(0.3)
    for n in (files, 0, 0):  # hashed and stamped once, then not hashed at all
        seen.clear()
        load_manifest(bundle)
        assert len(seen) == n, seen
    assert (tmp_path / "cache" / integrity.STAMP_FILE).is_file()
    load_manifest(bundle, stamps=False)
    assert len(seen) == files  # stamps=False hashes everything
    seen.clear()
    flip(bundle / "target.weights", keep_mtime=True)  # same size and mtime; the write still moved ctime
    with pytest.raises(BundleError, match="'target.weights'"):
        load_manifest(bundle)
    assert seen == ["target.weights"]
    flip(bundle / "target.weights")  # flipped back: the bytes are right again, and hashed to see so
    time.sleep(0.3)
    seen.clear()
    load_manifest(bundle)
    assert seen == ["target.weights"]
    with open(bundle / "draft.weights", "ab") as f:  # a size change is seen before any stamp is read
        f.write(b"\0")
    with pytest.raises(BundleError, match="'draft.weights'.*bytes"):
        load_manifest(bundle)


def test_unwritable_stamp_file_only_costs_hashing(bundle, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SPECDEC_CACHE", str(blocker / "cache"))  # a folder inside a file cannot be made
    monkeypatch.setattr(integrity, "RACY_NS", 0)
    load_manifest(bundle)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / integrity.STAMP_FILE).write_text("{not json")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    load_manifest(bundle)
    assert json.loads((tmp_path / "cache" / integrity.STAMP_FILE).read_text())["version"] == 1


def test_inspect_hashes_everything_and_names_the_file(bundle, monkeypatch):
    from click.testing import CliRunner

    from specdec.commands.cli.main import cli

    monkeypatch.setattr(integrity, "RACY_NS", 0)
    load_manifest(bundle)  # stamped
    seen = counting(monkeypatch)
    res = CliRunner().invoke(cli, ["inspect", str(bundle)])
    assert res.exit_code == 0, res.output
    assert len(seen) == len(load_manifest(bundle, verify="size").integrity["files"])
    assert "match their blake3 digests" in res.output
    flip(bundle / "tokenizer" / "tokenizer.json")
    bad = subprocess.run([sys.executable, "-m", "specdec", "inspect", str(bundle)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "'tokenizer/tokenizer.json' (tokenizer file)" in bad.stderr, bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_table_must_cover_what_is_loaded(bundle):
    edit(bundle, lambda m: m["integrity"]["files"].pop("tokenizer/tokenizer.json"))
    with pytest.raises(BundleError, match="tokenizer/tokenizer.json.*not in the manifest's integrity table"):
        load_manifest(bundle)
    edit(bundle, lambda m: m["integrity"].update(algorithm="md5"))
    with pytest.raises(BundleError, match="hashed with 'md5'"):
        load_manifest(bundle)
    edit(bundle, lambda m: m["integrity"].update(algorithm="blake3", files={**m["integrity"]["files"], "x": {"size": "1"}}))
    with pytest.raises(BundleError, match="integrity table is malformed"):
        load_manifest(bundle)


def test_older_bundle_without_a_table_still_loads(bundle):
    """A bundle of the previous specdec: sha256 of graphs and n-gram table only."""
    edit(bundle, lambda m: m.pop("integrity"))
    with pytest.warns(UserWarning, match="older specdec.*target.weights.*re-export"):
        load_manifest(bundle)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_manifest(bundle, verify="size")  # the opt-out asked for no more
    flip(bundle / "target.weights")
    with pytest.warns(UserWarning):
        load_manifest(bundle)  # not covered: the warning said so
    flip(bundle / "draft_step.onnx")
    with pytest.raises(BundleError, match=r"'draft_step.onnx' \(graph draft_step\) has sha256"), pytest.warns(UserWarning):
        load_manifest(bundle)


def test_generate_verifies_by_default_and_verify_size_is_the_opt_out(bundle):
    """``specdec generate`` refuses a byte-flipped weights file (exit 2, one line naming it);
    ``--verify size`` is the documented opt-out for a trusted bundle: it loads and decodes."""
    flip(bundle / "target.weights")
    cmd = [sys.executable, "-m", "specdec", "generate", str(bundle), "--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--json"]
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "target.weights" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    ok = subprocess.run([*cmd, "--verify", "size"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and len(json.loads(ok.stdout)["tokens"]) == 4, ok.stderr

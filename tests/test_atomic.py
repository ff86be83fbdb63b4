"""specdec/atomic.py: the one "hidden temporary, then rename" helper, for files and folders."""

from __future__ import annotations

import json

import pytest

from specdec.atomic import build_atomic, write_atomic


def test_a_file_is_written_whole_or_not_at_all(tmp_path):
    path = write_atomic(tmp_path / "plan.json", lambda fh: fh.write(b"{}"))
    assert path.read_bytes() == b"{}"

    def fail(fh):
        fh.write(b"half")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        write_atomic(tmp_path / "plan.json", fail)
    assert (tmp_path / "plan.json").read_bytes() == b"{}"  # the old file stands
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # no temporary left behind


def test_concurrent_writers_use_their_own_temporaries(tmp_path):
    path = tmp_path / "stamps.json"
    seen = []
    write_atomic(path, lambda fh: seen.append(fh.name) or fh.write(json.dumps({"n": 1}).encode()), unique=True)
    assert json.loads(path.read_text()) == {"n": 1}
    assert seen[0].endswith(".partial") and seen[0] != str(tmp_path / ".stamps.json.partial")


def test_a_folder_is_built_whole_or_not_at_all(tmp_path):
    out = tmp_path / "merged"
    assert build_atomic(out, lambda tmp: (tmp / "a").write_text("x") and "done") == "done"
    assert (out / "a").read_text() == "x"

    def fail(tmp):
        (tmp / "a").write_text("x")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_atomic(tmp_path / "other", fail)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]

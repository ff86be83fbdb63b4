"""``specdec demo``: exports a pair once into the cache, then decodes from the cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from test_cli import SPECDEC  # noqa: E402

from specdec.commands import demo  # noqa: E402
from specdec.errors import ModelError  # noqa: E402
from specdec.manifest import SCHEMA_VERSION  # noqa: E402

CHECKOUT_MODELS = demo.Path(demo.__file__).resolve().parents[2] / "models" / "demo"


def run_demo(env_cache, *args):
    cmd = [SPECDEC, "demo", *args] if SPECDEC else [sys.executable, "-m", "specdec", "demo", *args]
    env = {**os.environ, "SPECDEC_CACHE": str(env_cache)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def test_demo_exports_once_then_reuses_the_cache(llama_bundle, tmp_path):
    target, draft, _ = llama_bundle
    models = tmp_path / "models"
    models.mkdir()
    (models / "target").symlink_to(target)
    (models / "draft").symlink_to(draft)
    first = run_demo(tmp_path / "cache", "--models", str(models), "--max-new-tokens", "24")
    assert first.returncode == 0, first.stderr[-2000:]
    assert "exported the demo bundle" in first.stderr
    assert first.stdout.startswith(demo.PROMPT)
    assert "speedup" in first.stderr and "identical output" in first.stderr  # greedy: same tokens as autoregressive
    bundles = [b for b in (tmp_path / "cache").iterdir() if b.is_dir()]  # beside them: the verification stamps (verified.json)
    assert [b.name for b in bundles] == [f"demo-{demo.fingerprint(models)}-v{SCHEMA_VERSION}"]  # a newer schema re-exports
    second = run_demo(tmp_path / "cache", "--models", str(models), "--max-new-tokens", "24")
    assert second.returncode == 0 and "exported" not in second.stderr
    assert second.stdout == first.stdout


def test_demo_without_models_exits_2(tmp_path):
    res = run_demo(tmp_path / "cache", "--models", str(tmp_path / "none"))
    assert res.returncode == 2 and "demo target not found" in res.stderr and res.stderr.count("\n") == 1
    env = {**os.environ, "SPECDEC_CACHE": str(tmp_path / "cache"), demo.ENV: str(tmp_path / "elsewhere")}
    cmd = [SPECDEC, "demo"] if SPECDEC else [sys.executable, "-m", "specdec", "demo"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2 and str(tmp_path / "elsewhere") in res.stderr and res.stderr.count("\n") == 1


def test_demo_models_outside_a_checkout(tmp_path, monkeypatch):
    """Installed without a checkout, the demo says where the models can come from; the env var wins."""
    monkeypatch.delenv(demo.ENV, raising=False)
    monkeypatch.setattr(demo, "__file__", str(tmp_path / "site-packages" / "specdec" / "commands" / "demo.py"))
    with pytest.raises(ModelError, match=f"--models DIR.*{demo.ENV}"):
        demo.default_models()
    monkeypatch.setenv(demo.ENV, str(tmp_path / "pair"))
    assert demo.default_models() == tmp_path / "pair"


@pytest.mark.skipif(not (CHECKOUT_MODELS / "target" / "config.json").is_file(), reason="models/demo is not in this checkout")
def test_embedded_demo_pair_runs_the_quick_start_job(tmp_path):
    """The README's main job: `specdec demo` on the committed pair (greedy: output identical
    to autoregressive decoding, and the draft is accepted often)."""
    import re

    res = run_demo(tmp_path / "cache", "--max-new-tokens", "48")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith(demo.PROMPT) and len(res.stdout) > len(demo.PROMPT) + 20
    assert "identical output" in res.stderr
    rate = float(re.search(r"rate ([0-9.]+)", res.stderr).group(1))
    assert rate > 0.3, res.stderr  # a trained draft; random pairs accept ~0
    # The pair ships a feature head: its default mode was measured at export against the draft
    # model and the head's other modes on held-out prompts, and the fastest is the one decoding.
    (bundle,) = [b for b in (tmp_path / "cache").iterdir() if b.is_dir()]
    entry = json.loads((bundle / "manifest.json").read_text())["drafter"]
    speeds = entry["measured"]["tokens_per_s"]
    modes = [m for m in speeds if m != "autoregressive"]
    assert len(modes) >= 4 and any(m.startswith("model ") for m in modes) and any(m.startswith("feature ") for m in modes), speeds
    best = max(modes, key=speeds.get)
    assert best.startswith(f"{entry['name']} γ={entry['gamma']}") and entry["why"].startswith("measured at export"), entry
    assert f"mode: {entry['name']} at gamma {entry['gamma']}, measured at export" in res.stderr

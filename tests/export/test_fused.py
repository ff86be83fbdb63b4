"""Fused draft graphs (export/fused.py): γ draft steps and their token choices in one call.

Per family, both variants are composed from a tiny peaked draft's step graph, as the export
composes them, and checked by the export's own validation against PyTorch: greedy tokens are
PyTorch's argmax on the row's sequence, sampled tokens are the inverse CDF of the q row the graph returns, and that q row is NumPy's
``standardize`` of PyTorch's logits under temperature, top-k and top-p (to 1e-4, float32's
rounding over a softmax, as for every float32 graph) — across calls that roll back. On the
llama bundle (exported with --fused-draft) the runner is checked against the step graph: the
same KV rows and the same distributions. End to end, the decoder and batch tests run this
path on the llama bundle (tests/runtime).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from specdec.engines.fused import FusedRunner  # noqa: E402
from specdec.engines.executor import Executor  # noqa: E402
from specdec.engines.ort import fused_graph  # noqa: E402
from specdec.engines.sessions import open_session  # noqa: E402
from specdec.runtime.sampling import SamplingConfig, standardize  # noqa: E402

MAX_SEQ = 64
GAMMA = 3


@pytest.mark.parametrize("family", ["qwen2", "mistral", "gemma2", "gemma3", "gpt2", "opt", "gpt_neox"])  # llama: its bundle's own export validates it
def test_fused_graphs_match_pytorch_for_every_family(family, tmp_path):
    from models import config_for, peaked_model

    from specdec.export.families import family_of
    from specdec.export.fused import compose_fused
    from specdec.export.graphs import export_decoder, fix_tokens
    from specdec.export.optimize import optimize_for_cpu
    from specdec.export.validate_rows import validate_fused
    from specdec.manifest import GraphSpec, sha256_of

    model = peaked_model(config_for(family, "draft"), seed=3).eval()
    cfg = model.config
    fam = family_of(cfg, family)
    kv_heads, head_dim = fam.kv_heads(cfg), fam.head_dim(cfg)

    def spec(file, role, tokens, io_triple, batch=1):
        inputs, outputs, io = io_triple
        return GraphSpec(file, sha256_of(tmp_path / file), "draft", role, tokens, inputs, outputs, io, ("dyn.onnx.data",), "ort", batch)

    shape = (cfg.num_hidden_layers, kv_heads, head_dim, cfg.vocab_size, MAX_SEQ, "float32")
    io = export_decoder(model, tmp_path / "dyn.onnx", None, MAX_SEQ, kv_heads, head_dim, "float32")
    optimize_for_cpu(tmp_path / "dyn.onnx", MAX_SEQ)
    dynamic = ("draft_dynamic", spec("dyn.onnx", "dynamic", None, io))
    step = spec("step.onnx", "step", 1, fix_tokens(tmp_path / "dyn.onnx", tmp_path / "step.onnx", 1, *shape))  # as the export derives it
    kv = (cfg.num_hidden_layers, kv_heads, MAX_SEQ, head_dim, "float32")
    for greedy in (False, True):  # both variants: composing one is a few ms, not a trace
        file = f"fused_{greedy}.onnx"
        fused = compose_fused(tmp_path, step, tmp_path / file, GAMMA, MAX_SEQ, kv_heads, head_dim, cfg.vocab_size, "float32", greedy=greedy)
        figures = validate_fused(model, tmp_path, ("fused", spec(file, "fused", GAMMA, fused)), dynamic, kv, seed=1, rounds=6)
        assert figures["top1_agreement"] == 1.0 and (greedy or figures["logits"] < 1e-4), (family, greedy, figures)


def _prefilled(bundle, manifest, sessions, prompt) -> Executor:
    """A one-slot draft executor that has been fed prompt[:-1]."""
    draft = Executor(bundle, manifest, "draft", sessions, "cpu", slots=1)
    draft.forward([0], [np.array(prompt[:-1])])
    draft.commit(0, len(prompt) - 1)
    return draft


@pytest.mark.parametrize("family_bundle", ["llama"], indirect=True)
def test_fused_runner_writes_what_the_step_graph_writes(family_bundle):
    """The fused call's KV rows and q rows equal those of γ step-graph calls on its tokens."""
    _, _, _, out, manifest = family_bundle
    sessions = {n: open_session(out, n, manifest.graphs[n]) for n in manifest.graphs if manifest.graphs[n].batch == 1 and manifest.graphs[n].flavour == "ort"}
    prompt = [5, 17, 42, 99, 7, 3, 11]
    gamma = manifest.gamma
    for cfg in (SamplingConfig(0.0), SamplingConfig(1.0), SamplingConfig(0.7, top_k=20), SamplingConfig(1.0, top_p=0.8)):
        fused = _prefilled(out, manifest, sessions, prompt)
        runner = fused.fused(1, cfg.greedy)
        assert isinstance(runner, FusedRunner) and runner.gamma == gamma and (runner.io.uniforms is None) == cfg.greedy
        start = fused.length(0)
        tokens = runner.run((0,), (prompt[-1],), (cfg,), (np.random.default_rng(0),))[0].copy()
        probs = runner.probs[0].copy() if not cfg.greedy else None
        steps = _prefilled(out, manifest, sessions, prompt)
        rows = []  # [γ, V]: the step graph on the fed token and the first γ - 1 drafted ones
        for t in [prompt[-1], *tokens[:-1]]:
            rows.append(steps.forward([0], [np.array([t])])[0, 0].copy())
            steps.commit(0, 1)
        rows = np.stack(rows)
        end = start + gamma
        for a, b in zip((*fused.slot(0).keys, *fused.slot(0).values), (*steps.slot(0).keys, *steps.slot(0).values)):
            np.testing.assert_allclose(a[:, :, start:end], b[:, :, start:end], atol=1e-5)
        if cfg.greedy:
            assert tokens.tolist() == rows.argmax(-1).tolist()
        else:
            np.testing.assert_allclose(probs, standardize(rows, cfg), atol=1e-5)
            assert all(probs[j, t] > 0 for j, t in enumerate(tokens))  # every token has mass in its row


def test_bundles_without_fused_graphs_draft_step_by_step(llama_bundle):
    """--fused-draft is opt-in: a default bundle has no fused graph and the drafter says so."""
    from specdec.manifest import load_manifest
    from specdec.runtime import SpeculativeDecoder

    out = llama_bundle[2]
    m = load_manifest(out)
    assert fused_graph(m, "fused") is None and fused_graph(m, "fused_greedy") is None
    dec = SpeculativeDecoder.load(out)
    assert dec.engine.draft.fused(1, False) is None and dec.engine.draft.fused(1, True) is None
    res = dec.generate([5, 6, 7], max_new_tokens=12, gamma=m.gamma, ignore_eos=True)
    assert res.stats.draft_calls > 0


def test_fused_draft_plans_both_variants_per_batch_size(tmp_path):
    from specdec.export.pipeline import ExportConfig, planned_graphs

    names = {p.name for p in planned_graphs(ExportConfig("t", "d", tmp_path, max_batch=4, fused_draft=True))}
    assert {"draft_fused", "draft_fused_greedy", "draft_fused_batch2", "draft_fused_greedy_batch4"} <= names
    assert not any("fused" in p.name for p in planned_graphs(ExportConfig("t", "d", tmp_path, max_batch=4)))


@pytest.mark.parametrize("family_bundle", ["llama"], indirect=True)
def test_inspect_summarizes_a_bundle_with_fused_graphs(family_bundle):
    from click.testing import CliRunner

    from specdec.commands.cli.main import cli

    out = family_bundle[3]
    res = CliRunner().invoke(cli, ["inspect", str(out)])
    assert res.exit_code == 0, res.output
    assert "draft_fused_greedy_batch4" in res.output and "validated draft_fused " in res.output and "max|Δ q|" in res.output

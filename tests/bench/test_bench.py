"""``specdec bench`` and the measurement under it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from specdec.commands import bench


def test_stdlib_split_is_disjoint_and_stable():
    train, held = bench.stdlib_files(held_out=False), bench.stdlib_files(held_out=True)
    assert held and len(train) > 10 * len(held)
    assert not set(train) & set(held)
    assert bench.stdlib_files(held_out=True) == held
    assert not any("site-packages" in f.parts or "test" in f.parts for f in train + held)


def test_bench_cli_writes_table_json_and_plot(llama_bundle, tmp_path):
    pytest.importorskip("matplotlib")
    from test_cli import run

    out = tmp_path / "b"
    res = run("bench", str(llama_bundle[2]), "--gammas", "2,4", "--temperatures", "0,1", "--prompts", "2", "--drafters", "model,lookup,ngram",
              "--adaptive", "--prompt-tokens", "12", "--tokens", "16", "--rounds", "1", "--op-split", "--out", str(out))
    assert res.returncode == 0, res.stderr
    rows = json.loads((out / "results.json").read_text())
    prov = rows.pop("provenance")  # the results name the command that made them (docs/bench/README.md)
    splits = rows.pop("op_split")  # --op-split: the target's 1-token and verify calls, printed and stored
    assert [s["tokens"] for s in splits] == [1, 5] and all(s["groups_ms"]["matmul"] > 0 for s in splits)
    assert res.stdout.count("target_dynamic, ") == 2 and "GroupQueryAttention" in res.stdout
    assert prov["command"].split()[:3] in (["specdec", "bench", str(llama_bundle[2])], ["python", "-m", "specdec"]) and "--adaptive" in prov["command"]
    assert prov["machine"]["cores"] >= 1 and prov["versions"]["onnxruntime"]
    assert f"`{prov['command']}`" in (out / "results.md").read_text()
    assert set(rows) == {"T=0", "T=1"}
    for r in rows.values():
        assert [(x["drafter"], x["gamma"]) for x in r] == [("-", 0)] + [(d, g) for d in ("model", "lookup", "ngram") for g in (2, 4, "auto")]
        assert r[0]["speedup"] == 1.0 and all(x["tokens_per_s"] > 0 for x in r)
        assert all(0 <= x["alpha"] <= 1 and x["c"] >= 0 and x["v"] > 0 and len(x["per_position"]) == (4 if x["gamma"] == "auto" else x["gamma"]) for x in r[1:])
        model = [x for x in r if x["drafter"] == "model"]
        assert all(x["c"] > 0 for x in model) and [x["predicted"] is not None for x in model] == [True, True, False]
    assert (out / "bench.png").stat().st_size > 10_000
    assert "| drafter | γ | tok/s |" in (out / "results.md").read_text() and "planner's γ for model" in res.stdout
    assert "bandwidth floor" in res.stdout and all(x["floor_ratio"] > 0 and x["ms_per_token"] > 0 for r in rows.values() for x in r)


def test_bench_cli_chat_requests_go_through_the_template_and_end_at_eos(chat_bundle, tmp_path):
    """--corpus chat: the held-out everyday requests through the bundle's chat template; a request
    stops at EOS (its tokens may be fewer than --tokens), and γ = 0 and the drafter decode the same."""
    from test_cli import run

    from specdec.commands.bench.corpus import HELD_OUT, chat_prompts
    from specdec.runtime import SpeculativeDecoder

    out = tmp_path / "b"
    res = run("bench", str(chat_bundle[1]), "--corpus", "chat", "--gammas", "2", "--temperatures", "0", "--prompts", "2", "--tokens", "24",
              "--rounds", "1", "--out", str(out))  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "2 held-out requests (chat, through the chat template)" in res.stdout
    rows = json.loads((out / "results.json").read_text())["T=0"]
    assert [(x["drafter"], x["gamma"]) for x in rows] == [("-", 0), ("model", 2)]
    assert rows[0]["tokens"] == rows[1]["tokens"]  # greedy: the same outputs, so the same lengths
    dec = SpeculativeDecoder.load(chat_bundle[1])
    prompts = chat_prompts(chat_bundle[1], dec.manifest, dec.codec, "chat", 2)
    assert dec.codec.decode(prompts[0]).count(HELD_OUT[0]) == 1
    lengths = [len(dec.generate(p, max_new_tokens=24, gamma=0).tokens) for p in prompts]
    assert rows[0]["tokens"] == sum(lengths)


def test_code_prompts_are_function_openings_from_third_party_packages():
    from tokenizers import Tokenizer

    from specdec.commands.bench.corpus import CODE_PACKAGES, package_files

    tok = Tokenizer.from_file(str(Path(__file__).parents[2] / "models" / "demo" / "target" / "tokenizer.json"))
    encode = lambda text: tok.encode(text).ids  # noqa: E731
    prompts = bench.prompts("code", encode, 6, 32)
    assert len(prompts) == 6 and all(len(p) == 32 for p in prompts)
    assert all(tok.decode(p).lstrip().startswith(("def ", "async def ")) for p in prompts)
    assert bench.prompts("code", encode, 6, 32) == prompts  # stable
    stdlib = {str(f) for f in bench.stdlib_files(held_out=False) + bench.stdlib_files(held_out=True)}
    files = [f for p in CODE_PACKAGES for f in package_files(p)]
    assert files and not stdlib & {str(f) for f in files}
    with pytest.raises(ValueError, match="corpus 'web'"):
        bench.prompts("web", encode, 1, 8)


@pytest.mark.parametrize("corpus", ["functions", "code-functions"])
def test_function_sources_are_whole_functions(corpus):
    """Sources for encoder-decoder bundles: whole functions (they parse on their own) of
    length // 2 .. length tokens, from held-out stdlib files or third-party packages."""
    import ast

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(__file__).parents[2] / "models" / "demo" / "target" / "tokenizer.json"))
    encode = lambda text: tok.encode(text).ids  # noqa: E731
    sources = bench.prompts(corpus, encode, 5, 120)
    assert len(sources) == 5 and all(60 <= len(s) <= 120 for s in sources)
    for s in sources:
        tree = ast.parse(tok.decode(s))
        assert isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) and len(tree.body) == 1
    assert bench.prompts(corpus, encode, 5, 120) == sources  # stable


def test_bandwidth_floor_counts_weights_without_the_embedding_and_the_kv_rows(llama_bundle):
    from specdec.commands.bench.floor import Floor, call_bytes, read_bandwidth
    from specdec.manifest import load_manifest

    out = llama_bundle[2]
    m = load_manifest(out)
    weights = (out / "target.weights").stat().st_size
    t = m.target
    assert call_bytes(out, m, "target", 0) == weights - m.vocab_size * t.hidden_size * 4
    assert call_bytes(out, m, "target", 10) - call_bytes(out, m, "target", 0) == 10 * 2 * t.num_layers * t.num_kv_heads * t.head_dim * 4
    bw = read_bandwidth(8 * 2**20, repeats=2)
    assert 1e8 < bw < 1e13  # 0.1 GB/s .. 10 TB/s: a rate, not a time or a count
    f = Floor(bw, bw, call_bytes(out, m, "target", 5), call_bytes(out, m, "draft", 5))
    assert f.seconds(3, 8) == pytest.approx(3 * f.target_bytes / bw + 8 * f.draft_bytes / bw)


def test_alpha_mle_recovers_alpha_from_simulated_calls():
    rng = np.random.default_rng(0)
    for alpha in (0.2, 0.6, 0.9):
        acc = rej = 0
        for _ in range(4000):
            k = int(rng.integers(1, 6))  # proposals of varying length, as prompt lookup makes
            n = 0
            while n < k and rng.random() < alpha:
                n += 1
            acc, rej = acc + n, rej + (n < k)
        assert bench.alpha_mle(acc, rej) == pytest.approx(alpha, abs=0.02)


@pytest.mark.parametrize("args,msg", [(["--tokens", "0"], "--tokens 0"), (["--gammas", "1,x"], "--gammas"), (["--gammas", "9"], "gamma must be 0..4"),
                                      (["--drafters", "model,beam"], "'beam' is not one of"),
                                      (["--provider", "cuda-graph", "--op-split"], "--op-split profiles the CPU provider's calls"),
                                      (["--provider", "cuda-graph"], "onnxruntime lacks")])
def test_bench_cli_bad_input(llama_bundle, args, msg):
    import onnxruntime as ort

    from test_cli import run

    if "onnxruntime lacks" in msg and "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine has CUDA, so the provider is not refused")

    res = run("bench", str(llama_bundle[2]), *args)
    assert res.returncode == 2 and msg in res.stderr and res.stderr.count("\n") == 1


def test_synthetic_acceptance_keeps_drafts_at_the_asked_rate(llama_bundle):
    """Benchmark-only: the real graphs run, then each draft is kept with probability A; A = 1 and
    0 are exact bounds, A = 0.6 is recovered by the MLE within 5 binomial standard deviations."""
    from specdec.commands.bench.synthetic import enable
    from specdec.errors import ConfigError, InputError
    from specdec.runtime.batch import BatchEngine
    from specdec.runtime.decoder import SpeculativeDecoder

    out = llama_bundle[2]
    dec = SpeculativeDecoder.load(out)
    with pytest.raises(InputError, match="synthetic_acceptance=0.5: not a request field; it is benchmark-only"):
        dec.generate([1, 2, 3], max_new_tokens=4, synthetic_acceptance=0.5)
    real = dec.generate([1, 2, 3], max_new_tokens=24, gamma=4, ignore_eos=True)
    assert real.stats.synthetic is None and real.stats.as_dict()["exact"]
    for rate in (1.0, 0.0):
        enable(dec, rate)
        s = dec.generate([1, 2, 3], max_new_tokens=25, gamma=4, ignore_eos=True).stats
        assert s.synthetic == rate and not s.as_dict()["exact"] and "SYNTHETIC" in s.line()
        assert s.accepted == (s.drafted if rate else 0) and s.drafted > 3.5 * s.verify_calls  # the draft ran at full width (γ shrinks at the budget)
    enable(dec, 0.6)
    acc = rej = 0
    for seed in range(12):
        s = dec.generate([5, 6, 7], max_new_tokens=60, gamma=4, ignore_eos=True, temperature=1.0, seed=seed).stats
        acc, rej = acc + s.accepted, rej + s.rejected
    est, trials = bench.alpha_mle(acc, rej), acc + rej
    assert abs(est - 0.6) < 5 * (0.6 * 0.4 / trials) ** 0.5, f"{acc} kept of {trials} trials"
    with BatchEngine(out) as engine:
        enable(engine, 1.0)
        hs = [engine.submit([1, 2, 3], max_new_tokens=21, gamma=4, ignore_eos=True) for _ in range(2)]
        assert all(h.result(timeout=60).stats.accepted == 16 for h in hs)  # 4 calls of 4 kept + 1
    with pytest.raises(ConfigError, match="--synthetic-acceptance 1.5"):
        enable(dec, 1.5)


def test_bench_cli_synthetic_tables_are_labelled(llama_bundle, tmp_path):
    from test_cli import run

    out = tmp_path / "s"
    res = run("bench", str(llama_bundle[2]), "--gammas", "2", "--temperatures", "0", "--prompts", "1", "--prompt-tokens", "12",
              "--tokens", "16", "--rounds", "1", "--synthetic-acceptance", "1", "--out", str(out))
    assert res.returncode == 0, res.stderr
    data = json.loads((out / "results.json").read_text())
    assert data["synthetic_acceptance"] == 1.0 and res.stdout.startswith("SYNTHETIC")
    (row,) = [r for r in data["T=0"] if r["gamma"] == 2]
    assert "**T=0, SYNTHETIC acceptance 1**" in res.stdout
    assert row["alpha"] == 1.0 and row["tokens_per_call"] > 2.5  # 3 per verify call; the prefill's step is plain


def test_bench_batch_cli_every_mode_and_synthetic_label(llama_bundle, tmp_path):
    """Every mode at every concurrency, labelled; the batch-1 bundle queues the second client
    (batching itself is tests/runtime/test_batch.py's)."""
    from test_cli import run

    out = tmp_path / "bb"
    res = run("bench-batch", str(llama_bundle[2]), "--concurrency", "1,2", "--temperatures", "0", "--requests", "1", "--prompt-tokens", "12",
              "--tokens", "9", "--synthetic-acceptance", "1", "--timeout", "60", "--out", str(out))
    assert res.returncode == 0, res.stderr
    data = json.loads((out / "results.json").read_text())
    rows = data["rows"]
    assert "bench-batch" in data["provenance"]["command"]
    assert {(r["concurrency"], r["mode"]) for r in rows} == {(n, m) for n in (1, 2) for m in ("batched adaptive", "batched γ=4", "batched plain", "fork per thread")}
    assert all(r["synthetic_acceptance"] == 1.0 and r["tok_s"] > 0 and r.get("errors", 0) == 0 for r in rows)
    assert res.stdout.startswith("SYNTHETIC") and (out / "results.md").read_text().startswith("SYNTHETIC")
    bad = run("bench-batch", str(llama_bundle[2]), "--synthetic-acceptance", "2")
    assert bad.returncode == 2 and "--synthetic-acceptance 2" in bad.stderr and bad.stderr.count("\n") == 1


def test_op_split_counts_each_node_of_a_call_once(llama_bundle, tmp_path):
    """The profile's kernels, per call: as many of each op as the graph ORT runs holds (its
    optimized form), their times inside the call's, grouped as MatMul / attention / other."""
    import onnxruntime as ort

    from specdec.commands.bench.opsplit import profile_calls
    from specdec.engines.threads import ThreadPolicy
    from specdec.manifest import load_manifest

    out = llama_bundle[2]
    manifest = load_manifest(out)
    split = profile_calls(out, manifest, tokens=2, calls=6, context=8, threads=1)
    name, spec = manifest.graph("target", "dynamic")
    options = ThreadPolicy.of(1).session_options()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(out / spec.file), options, providers=["CPUExecutionProvider"])
    import onnx

    nodes = onnx.load(options.optimized_model_filepath, load_external_data=False).graph.node
    counts = {}
    for n in nodes:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    assert {op: n for op, (_, n) in split.ops.items()} == {op: float(n) for op, n in counts.items() if op in split.ops}
    assert set(counts) - set(split.ops) <= {"Constant"}  # every op that runs was seen
    g = split.groups
    assert g["matmul"] > 0 and g["attention"] > 0 and g["other"] > 0
    assert sum(g.values()) <= split.call_ms and split.tokens == 2 and split.calls == 6
    assert "MatMul" in split.lines()[0] and json.dumps(split.as_dict())


def test_results_name_the_command_as_typed():
    """A results file's command is what a user types again: ``python -m specdec`` (not the path
    of specdec's __main__.py), a console script by its name, a tools/ script relative to the checkout."""
    from specdec.commands.bench.report import REPO, command_line

    main = str(REPO / "specdec" / "__main__.py")
    assert command_line([main, "bench", "B", "--tokens", "8"]) == "python -m specdec bench B --tokens 8"
    assert command_line(["/usr/bin/specdec", "bench", "B"]) == "specdec bench B"
    assert command_line([str(REPO / "tools" / "ab.py"), "B", "--rounds", "5"]) == "python tools/ab.py B --rounds 5"

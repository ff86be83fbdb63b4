"""``specdec bench-peers`` on a tiny pair: transformers and specdec, interleaved, agreeing at T = 0."""

from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize("family_bundle", ["llama"], indirect=True)  # the shared llama pair: a near draft, and its bundle
def test_bench_peers_hf_and_specdec(family_bundle, tmp_path):
    from test_cli import run

    _, target, draft, bundle, _ = family_bundle
    out = tmp_path / "peers"
    res = run("bench-peers", "--only", "hf,specdec", "--target", str(target), "--draft", str(draft), "--bundle", str(bundle),
              "--prompts", "1", "--prompt-tokens", "8", "--tokens", "12", "--rounds", "1", "--temperatures", "0",
              "--work", str(tmp_path / "work"), "--out", str(out))
    assert res.returncode == 0, res.stderr
    data = json.loads((out / "results.json").read_text())
    assert "bench-peers" in data["provenance"]["command"] and "Regenerate:" in (out / "results.md").read_text()
    rows = {(r["peer"], r["mode"]): r for r in data["rows"]}
    want = {("hf", "autoregressive"), ("hf", "assisted"), *(("specdec", m) for m in
            ("autoregressive", "default", "draft-model", "draft-model-adaptive", "prompt-lookup", "ngram", "hierarchical"))}
    assert set(rows) == want and all(r["T"] == 0 for r in rows.values())
    assert not {k: r["unavailable"] for k, r in rows.items() if "unavailable" in r}
    assert all(r["tokens_per_s"] > 0 and r["tokens"] > 0 for r in rows.values())
    assert len(data["prompts"]) == 1 and len(data["prompts"][0]) == 8
    # Greedy agreement with transformers' autoregressive tokens, of exact decoding in both stacks
    for key in (("specdec", "autoregressive"), ("specdec", "default"), ("specdec", "draft-model"), ("hf", "assisted")):
        assert rows[key]["greedy_same_as_reference"] == "1/1", (key, rows[key]["outputs_round0"], rows[("hf", "autoregressive")]["outputs_round0"])
    assert rows[("specdec", "draft-model")]["acceptance"] is not None and rows[("specdec", "draft-model")]["speedup"] > 0
    assert "| specdec | draft-model | 0 |" in res.stdout and "greedy = hf autoregressive" in res.stdout


@pytest.mark.parametrize("args, word", [(["--only", "hf,vllm"], "vllm"), (["--tokens", "1"], "--tokens")])
def test_bench_peers_bad_input_exits_2_with_one_line(tmp_path, args, word):
    from test_cli import run

    res = run("bench-peers", "--target", str(tmp_path), "--draft", str(tmp_path), *args)
    assert res.returncode == 2 and word in res.stderr and res.stderr.count("\n") == 1, res.stderr


def test_bench_peers_chat_requests_and_modes(chat_bundle, tmp_path):
    """--corpus chat: whole held-out requests through the bundle's chat template; --modes keeps the
    asked modes only; without --draft, transformers' assisted mode is listed as unavailable."""
    from test_cli import run

    from specdec.commands.bench.corpus import chat_prompts
    from specdec.runtime import SpeculativeDecoder

    target, bundle = chat_bundle
    out = tmp_path / "peers"
    res = run("bench-peers", "--only", "hf,specdec", "--modes", "autoregressive,assisted,default", "--target", str(target), "--bundle", str(bundle),
              "--corpus", "chat", "--prompts", "2", "--tokens", "10", "--rounds", "1", "--temperatures", "0", "--work", str(tmp_path / "work"),
              "--out", str(out))
    assert res.returncode == 0, res.stderr
    data = json.loads((out / "results.json").read_text())
    dec = SpeculativeDecoder.load(bundle)
    assert data["prompts"] == chat_prompts(bundle, dec.manifest, dec.codec, "chat", 2)
    rows = {(r["peer"], r["mode"]): r for r in data["rows"]}
    assert set(rows) == {("hf", "autoregressive"), ("hf", "assisted"), ("specdec", "autoregressive"), ("specdec", "default")}
    assert rows[("hf", "assisted")]["unavailable"] == "no --draft given"
    assert data["settings"]["specdec"]["default"] == {"drafter": dec.manifest.default_drafter()[0], "gamma": dec.manifest.default_drafter()[1]}
    for key in (("specdec", "autoregressive"), ("specdec", "default")):
        assert rows[key]["greedy_same_as_reference"] == "2/2", (key, rows[key]["outputs_round0"], rows[("hf", "autoregressive")]["outputs_round0"])


@pytest.mark.parametrize("args, word", [(["--modes", "autoregressive,warp"], "warp"), (["--corpus", "chat"], "--bundle")])
def test_bench_peers_bad_modes_and_chat_without_bundle(chat_bundle, tmp_path, args, word):
    from test_cli import run

    target, _ = chat_bundle
    res = run("bench-peers", "--only", "hf", "--target", str(target), *args)
    assert res.returncode == 2 and word in res.stderr and res.stderr.count("\n") == 1, res.stderr


def test_greedy_agreement_counts_the_tokens_both_wrote():
    """transformers may end a request early; its tokens agree if they are the reference's first ones."""
    from specdec.commands.bench.peers.cli import agree

    assert agree([5, 6, 7], [5, 6, 7, 8]) and agree([5, 6, 7, 8], [5, 6, 7])
    assert not agree([5, 6, 9], [5, 6, 7, 8]) and not agree([], [5]) and not agree(None, [5])

#!/usr/bin/env python3
"""Decoding speed of the peers a user would otherwise reach for, on one target/draft pair.

For ONE pair of Hugging Face Llama checkpoints (folders with config.json, float16/float32
safetensors and tokenizer files) this measures end-to-end decoding speed of:

* ``specdec``  (with ``--bundle``, a bundle exported from the same pair) specdec's own runtime in
               the same interleaved run: autoregressive, draft model at γ = K, adaptive γ, prompt
               lookup, n-gram table and hierarchical drafters (``SpecdecPeer``).
* ``hf``       transformers ``generate`` on PyTorch CPU: the target alone (autoregressive) and
               assisted generation (``assistant_model=draft``; with sampling, transformers uses
               speculative sampling).
* ``optimum``  optimum-onnx ``ORTModelForCausalLM`` (exported once with ``export=True`` into
               ``.bench/peers/optimum/``): the target alone, through the same ``generate``.
* ``genai``    onnxruntime-genai (its model builder writes the target and draft graphs into
               ``.bench/peers/genai/``): the target alone, genai's draft-model speculative
               decoding (a composite ``genai_config.json`` with ``model.type = "speculative"``
               and a ``model.draft`` decoder, ``speculative.max_draft_tokens`` = K) and its
               n-gram decoding (no draft; ``set_speculative_options(ngram_size=N, max_draft_tokens=K)``).
* ``openvino`` OpenVINO GenAI ``LLMPipeline`` on CPU (target and draft exported by optimum-intel
               to OpenVINO IR at fp32, weights not compressed, with the tokenizer converted by
               openvino-tokenizers, into ``.bench/peers/openvino/``): the target alone,
               ``draft_model=`` with ``num_assistant_tokens`` = K, and ``prompt_lookup=True``
               (``max_ngram_size`` = ``--ngram-size``); ``INFERENCE_NUM_THREADS`` = ``--threads``.
* ``llamacpp`` llama.cpp through llama-cpp-python (built from source for this CPU; the target
               converted to GGUF by llama.cpp's ``convert_hf_to_gguf.py`` into
               ``.bench/peers/llamacpp/``): the target alone and with the binding's prompt
               lookup (``LlamaPromptLookupDecoding(num_pred_tokens=K)`` as ``draft_model=``), at
               F32 (unsuffixed modes), Q8_0 and Q4_0 (modes ending ``-q8_0``/``-q4_0``, whose
               speedup is over that width's autoregressive run); ``n_threads`` = ``--threads``. The binding has no
               draft-model drafter, so that mode is listed as unavailable.

genai, openvino and llamacpp each live in a private venv (``.bench/genai-venv``,
``.bench/openvino-venv``, ``.bench/llamacpp-venv``) and run in a worker process of that venv's
python (``tools/genai_worker.py``, ``tools/openvino_worker.py``, ``tools/llamacpp_worker.py``)
answering JSON lines (``tools/jsonl_worker.py``). On first use each venv is created and each
model converted (progress on stderr, pip's output in ``.bench/<venv>.install.log``); the
llama.cpp build takes ~12 min on 2 cores, the others a minute or two. ``--no-setup`` creates
nothing and lists the peers whose venv or models are missing as unavailable. A failed install
or conversion makes that peer unavailable with the reason; the run goes on. Pinned versions,
verified together (Python 3.11, CPU; each in its module's ``VenvSpec``):

* genai:    onnxruntime-genai 0.18.0, transformers 5.23.0, torch 2.13.0, onnx 1.23.2, onnx_ir 1.1.0;
* openvino: openvino 2026.4.1, openvino-genai 2026.4.1.0, openvino-tokenizers 2026.4.1.0,
            optimum-intel[openvino] 2.2.0, optimum 2.3.0, transformers 5.5.4, nncf 3.4.0,
            torch 2.13.0 (torchvision, which optimum-intel pulls in as a CUDA build, is removed);
* llamacpp: llama-cpp-python 0.3.36 (CMAKE_ARGS: native CPU, no BLAS/GPU, no llava), gguf
            0.19.0, sentencepiece 0.2.3, torch 2.13.0, transformers 4.57.6 (the converter's).

Prompts are ``specdec bench``'s (``specdec.bench.prompts``): ``--corpus code`` (default)
takes function openings from third-party packages the demo pair never saw, ``--corpus
stdlib`` the openings of held-out CPython stdlib files; ``--prompts`` of them, the first
``--prompt-tokens`` tokens of each (the target's tokenizer via ``transformers.AutoTokenizer``,
special tokens as transformers adds them). Every peer gets these token ids as they are
(OpenVINO as an ``ov.Tensor``, llama.cpp as a token list), so prompts agree token for token.
Every request asks for exactly ``--tokens`` new tokens with EOS ignored (transformers: no EOS
id given to ``generate``; genai: ``min_length = max_length``; OpenVINO: ``ignore_eos``;
llama.cpp: ``generate`` never stops by itself), greedy (T = 0) and pure sampling at T = 1 (no
top-k / top-p / min-p in any peer). torch threads, every ONNX Runtime session's intra-op
threads, OpenVINO's and llama.cpp's threads are ``--threads``. Each (peer, mode, T) makes one
8-token warm-up call (seed 0); then rounds are interleaved: each round decodes every prompt once
with every (peer, mode, T), seeded by round and prompt, so machine noise hits all alike.

What is timed is decoding only: from the moment the first new token(s) are available (prefill
done) to the last token, and the tokens counted are those that appeared after that moment.
For transformers and optimum the moments come from a streamer (``put`` is called per step, or
per accepted chunk in assisted generation); for OpenVINO from a ``StreamerBase`` whose
``write`` is called per generation step (its ``perf_metrics`` TTFT and generate duration are
kept as statistics, not used); for llama.cpp from the tokens ``generate`` yields; for genai
from ``generate_next_token`` and, in its speculative modes,
``get_speculative_stats()["tokens_buffered"]`` (a round's extra tokens are buffered and handed
out one per call, so they are not counted as decoded after the first one). ``specdec bench``
instead counts all N tokens over total minus prefill time; for N >> 1 the two agree.

Reported per (peer, mode, T): tokens/s, speedup over the same peer's autoregressive run at the
same T (``Peer.baseline``), new tokens per target forward pass (prefill pass included;
transformers: counted with a forward hook; genai: from its stats; OpenVINO: streamer writes;
llama.cpp: ``eval`` calls) and acceptance (accepted / evaluated draft tokens: genai's stats,
OpenVINO's ``extended_perf_metrics`` in draft mode, llama.cpp's counted proposals; n-gram lookup
hit rate: genai). At T = 0 the table also says on how many prompts each (peer, mode) wrote
exactly the tokens of the first autoregressive peer (round 0): exact speculative decoding must
agree with it, up to floating-point near-ties between runtimes (Q8_0 weights are a different
model and need not agree). A mode that a peer lacks or that fails is listed with the reason; no
number is ever made up.

Things to know when reading the numbers: genai samples at T = 1 with ``top_k = 0`` (the full
vocabulary), which its CPU search does much more slowly than greedy or top-k sampling (about
0.5 ms per token at a 4096-token vocabulary, measured), so genai's T = 1 rows include that
cost. OpenVINO GenAI 2026.4's draft-model mode with sampling fails an internal check for some
seeds (seed 0 among them: the warm-up), a known upstream bug (openvino.genai issue 4190) that
also corrupts the output when it does not fail, so that row is listed with the error (and the
pipeline is rebuilt: once it has failed, it stops drafting in greedy requests too).
llama.cpp parallelizes every graph op over its threads and meets at a barrier after each, which
on a model this small costs more than it gains: on the 2-core development machine the demo
target decodes about 3x faster with ``n_threads = 1`` than with 2 (420 vs 105-150 tok/s at F32,
measured alone), and its 2-thread rows suffer most when anything else loads the CPU.
transformers adapts its assistant's settings across calls; they are reset before every request
so that the order of requests does not matter. Build outputs are cached under ``.bench/peers/``
(keyed by checkpoint path, file sizes and mtimes).

Reproduce (writes results.json and results.md under ``--out``, default .bench/peers/, and
prints the table)::

    python tools/bench_peers.py --target DIR --draft DIR [--bundle BUNDLE] [--corpus code] [--prompts 4] \
        [--prompt-tokens 64] [--tokens 128] [--rounds 2] [--threads 2] \
        [--only hf,optimum,genai,openvino,llamacpp,specdec] [--draft-tokens K] [--ngram-size 3] [--no-setup]
    specdec bench BUNDLE --prompts 4 --prompt-tokens 64 --tokens 128 --rounds 2 --threads 2

``--draft-tokens K`` pins the proposal width of every speculative peer (transformers:
``num_assistant_tokens = K`` with the constant schedule and no confidence early-stop; genai:
``max_draft_tokens = K``; OpenVINO: ``num_assistant_tokens = K``; llama.cpp: ``num_pred_tokens
= K``); by default each peer keeps its own default (transformers 20 with a 0.4 confidence
early-stop; genai 4; llama-cpp-python's lookup 10; OpenVINO has none and gets 4), as a user
would.

Each peer is one module of ``tools/peers/`` (``peers.PEER_CLASSES``); this file runs them.
"""


from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from peers import OUT, PEER_CLASSES, PEERS, ModeUnavailable, Peer, Sample, Tally, log
from specdec.bench import CORPORA

WARMUP_TOKENS = 8

Key = tuple[str, str, float]  # (peer, mode, T)


def prompts_for(target: Path, corpus: str, count: int, length: int) -> list[list[int]]:
    """``specdec bench``'s prompts from ``corpus``, tokenized by the target's own tokenizer."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from specdec.bench import prompts

    hf_logging.set_verbosity_error()  # whole source files exceed model_max_length; only a prefix is used
    tok = AutoTokenizer.from_pretrained(target)
    got = prompts(corpus, lambda text: tok(text)["input_ids"], count, length)
    if len(got) < count:
        raise SystemExit(f"the {corpus} corpus has only {len(got)} texts long enough for {count} prompts of {length} "
                         "tokens; lower --prompts or --prompt-tokens")
    return got


def start_peers(args) -> tuple[list[Peer], dict[Key, str]]:
    """The requested peers, in ``--only``'s (start) order; a peer that cannot start is recorded
    (with why) instead."""
    peers, unavailable = [], {}
    for name in args.only:
        log(f"starting {name}")
        try:
            peers.append(PEER_CLASSES[name].from_args(args))
        except Exception as exc:  # noqa: BLE001 - a missing peer is a result
            log(f"{name} unavailable: {one_line(exc)}")
            for mode in PEER_CLASSES[name].modes:
                for t in args.temps:
                    unavailable[(name, mode, t)] = one_line(exc)
    return peers, unavailable


def one_line(exc: Exception) -> str:
    """``Type: first line of the message`` (ModeUnavailable: the message alone)."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return text if isinstance(exc, ModeUnavailable) else f"{type(exc).__name__}: {text}"


def attempt(peer: Peer, mode: str, t: float, prompt: list[int], tokens: int, seed: int, unavailable: dict[Key, str]) -> Sample | None:
    """``peer.decode``, or None once (peer, mode, T) has failed; the first failure is recorded."""
    key = (peer.name, mode, t)
    if key in unavailable:
        return None
    try:
        return peer.decode(mode, t, prompt, tokens, seed)
    except Exception as exc:  # noqa: BLE001 - one failing mode must not sink the others
        unavailable[key] = one_line(exc)
        log(f"{peer.name}/{mode}/T={t:g} unavailable: {unavailable[key]}")
        return None


def measure(peers: list[Peer], prompts: list[list[int]], temps: list[float], tokens: int, rounds: int,
            unavailable: dict[Key, str]) -> dict[Key, Tally]:
    """Warm-up once per (peer, mode, T), then interleaved rounds over prompts, T, peers and modes.

    Seeds are 1000 * round + prompt index, the same for every peer (``specdec bench``'s too).
    Round 0's outputs are kept per prompt for the greedy agreement check.
    """
    tallies: dict[Key, Tally] = {}
    for peer in peers:
        for mode in peer.modes:
            for t in temps:
                attempt(peer, mode, t, prompts[0], WARMUP_TOKENS, 0, unavailable)
    for r in range(rounds):
        log(f"round {r + 1}/{rounds}")
        for i, prompt in enumerate(prompts):
            for t in temps:
                for peer in peers:
                    for mode in peer.modes:
                        s = attempt(peer, mode, t, prompt, tokens, 1000 * r + i, unavailable)
                        if s is not None:
                            tally = tallies.setdefault((peer.name, mode, t), Tally())
                            tally.add(s)
                            if r == 0:
                                tally.outputs[i] = s.ids
    return tallies


def ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def target_passes(tally: Tally) -> float | None:
    """Target forward passes over all requests, the prefill pass included (None: not known)."""
    st = tally.stats
    if "target_forward_passes" in st:  # genai: verify/re-anchor passes + standard steps, plus the prefill
        return st["target_forward_passes"] + st["standard_fallback_steps"] + tally.requests
    return st.get("target_passes")  # transformers' forward hook (assisted mode only)


def greedy_agreement(tallies: dict[Key, Tally], order: list[tuple[str, str]]) -> tuple[str | None, dict[tuple[str, str], str]]:
    """For T = 0: on how many prompts each (peer, mode) wrote exactly the reference's tokens.

    The reference is the first autoregressive peer measured at T = 0 (exact speculative
    decoding must agree with it up to floating-point ties between runtimes).
    """
    ref = next((p for p, m in order if m == "autoregressive" and (p, m, 0.0) in tallies), None)
    if ref is None:
        return None, {}
    want = tallies[(ref, "autoregressive", 0.0)].outputs
    out = {}
    for p, m in order:
        got = tallies.get((p, m, 0.0))
        if got is not None:
            same = sum(got.outputs.get(i) == ids for i, ids in want.items())
            out[(p, m)] = f"{same}/{len(want)}"
    return f"{ref} autoregressive", out


def summarize(tallies: dict[Key, Tally], unavailable: dict[Key, str], order: list[tuple[str, str]],
              temps: list[float]) -> tuple[list[dict], str | None]:
    """One row per (peer, mode, T): speed, speedup over the peer's own autoregressive run, stats."""
    ref, agree = greedy_agreement(tallies, order)
    rows = []
    for peer, mode in order:
        for t in temps:
            row: dict[str, Any] = {"peer": peer, "mode": mode, "T": t}
            tally = tallies.get((peer, mode, t))
            if (peer, mode, t) in unavailable or tally is None:
                row["unavailable"] = unavailable.get((peer, mode, t), "no measurement")
                rows.append(row)
                continue
            base_mode = PEER_CLASSES[peer].baseline(mode)
            base = tallies.get((peer, base_mode, t)) if base_mode else None
            tps = tally.tokens / tally.seconds
            st = tally.stats
            passes = target_passes(tally)
            row.update(tokens_per_s=tps, seconds=tally.seconds, tokens=tally.tokens, requests=tally.requests,
                       speedup=ratio(tps, base.tokens / base.seconds) if base else None,
                       tokens_per_target_pass=ratio(tally.new_tokens, passes) if passes else None,
                       acceptance=ratio(st.get("draft_tokens_accepted", 0), st.get("draft_tokens_evaluated", 0)),
                       ngram_hit_rate=ratio(st.get("ngram_lookup_hits", 0), st.get("ngram_lookup_hits", 0) + st.get("ngram_lookup_misses", 0)),
                       greedy_same_as_reference=agree.get((peer, mode)) if t == 0 else None,
                       stats=st, outputs_round0=tally.outputs)
            rows.append(row)
    return rows, ref


def fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def markdown(rows: list[dict], header: str, ref: str | None) -> str:
    """The table: peer, mode, T, tokens/s, speedup, tokens per target pass, acceptance, agreement."""
    lines = [header, "",
             f"| peer | mode | T | tok/s | speedup vs own AR | new tokens / target pass | acceptance (accepted/evaluated) "
             f"| n-gram hit rate | greedy = {ref or 'reference'} | notes |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "unavailable" in r:
            note = r["unavailable"].replace("|", "\\|")
            lines.append(f"| {r['peer']} | {r['mode']} | {r['T']:g} | n/a | – | – | – | – | – | unavailable: {note} |")
            continue
        lines.append(f"| {r['peer']} | {r['mode']} | {r['T']:g} | {r['tokens_per_s']:.1f} | {fmt(r['speedup'], '.2f')} | "
                     f"{fmt(r['tokens_per_target_pass'], '.2f')} | {fmt(r['acceptance'], '.3f')} | "
                     f"{fmt(r['ngram_hit_rate'], '.3f')} | {r['greedy_same_as_reference'] or '–'} | |")
    return "\n".join(lines) + "\n"


def versions() -> dict[str, str]:
    """Library versions of this (system) python; the venv peers' come from their workers (settings)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for dist in ("torch", "transformers", "onnxruntime", "optimum", "optimum-onnx"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "missing"
    return out


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True, help="HF checkpoint folder of the target")
    ap.add_argument("--draft", type=Path, required=True, help="HF checkpoint folder of the draft (same tokenizer)")
    ap.add_argument("--bundle", type=Path, default=None, help="specdec bundle exported from --target/--draft (specdec's rows)")
    ap.add_argument("--corpus", choices=CORPORA, default="code",
                    help="prompts: function openings of third-party packages (code) or held-out stdlib files (stdlib)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per request (EOS ignored)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch threads and ORT intra-op threads")
    ap.add_argument("--temperatures", default="0,1", help="comma-separated; 0 = greedy")
    ap.add_argument("--only", default=",".join(PEERS), help=f"comma-separated subset of {','.join(PEERS)}")
    ap.add_argument("--draft-tokens", type=int, default=None,
                    help="pin every speculative peer's proposal width K [default: each peer's own default]")
    ap.add_argument("--ngram-size", type=int, default=3,
                    help="genai n-gram decoding: N (matches the last N-1 tokens); openvino and llamacpp prompt lookup: max_ngram_size")
    ap.add_argument("--out", type=Path, default=OUT, help="where results.json/results.md go")
    ap.add_argument("--note", default="", help="a line written under the table (e.g. what else loaded the machine)")
    ap.add_argument("--no-setup", dest="setup", action="store_false",
                    help="do not create missing private venvs or converted models: list those peers as unavailable")
    ap.add_argument("--setup-genai", action="store_true", help=argparse.SUPPRESS)  # the old opt-in; setup is now the default
    args = ap.parse_args(argv)
    args.only = [p.strip() for p in args.only.split(",") if p.strip()]
    args.only = sorted(dict.fromkeys(args.only), key=lambda p: PEERS.index(p) if p in PEERS else -1)  # specdec starts last
    if "specdec" in args.only and args.bundle is None:
        args.only.remove("specdec")
    bad = [p for p in args.only if p not in PEERS]
    if bad:
        ap.error(f"--only: unknown peer(s) {bad}; choose from {PEERS}")
    for name in ("prompts", "prompt_tokens", "rounds", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.tokens < 2:
        ap.error("--tokens must be >= 2 (the first token closes the prefill)")
    if args.draft_tokens is not None and not 1 <= args.draft_tokens <= 16:
        ap.error("--draft-tokens must be in [1, 16] (genai's range)")
    args.temps = [float(t) for t in args.temperatures.split(",") if t.strip()]
    return args


def check_context(target: Path, prompt_tokens: int, tokens: int) -> None:
    """Prompt plus new tokens must fit the target's context."""
    ctx = json.loads((target / "config.json").read_text()).get("max_position_embeddings")
    if ctx and prompt_tokens + tokens > ctx:
        raise SystemExit(f"--prompt-tokens + --tokens = {prompt_tokens + tokens} exceeds the target's context ({ctx})")


def write_results(args, prompts: list[list[int]], peers: list[Peer], rows: list[dict], ref: str | None) -> None:
    """results.json and results.md under ``--out``; the table and the peers' settings to stdout."""
    header = (f"target {args.target}, draft {args.draft}: {len(prompts)} {args.corpus} prompts of {args.prompt_tokens} tokens "
              f"x {args.rounds} rounds x {args.tokens} new tokens (EOS ignored), {args.threads} threads, interleaved; "
              f"tok/s = decoding after the first new token")
    md = markdown(rows, header, ref)
    settings = {p.name: p.settings for p in peers}
    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    (args.out / "results.json").write_text(json.dumps(
        {"config": config, "versions": versions(), "settings": settings, "prompts": prompts, "rows": rows}, indent=1))
    note = f"\nNote: {args.note}\n" if args.note else ""
    (args.out / "results.md").write_text(md + note + "\nsettings: " + json.dumps(settings) + "\n")
    print(md)
    print("settings:", json.dumps(settings))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_context(args.target, args.prompt_tokens, args.tokens)
    prompts = prompts_for(args.target, args.corpus, args.prompts, args.prompt_tokens)
    log(f"{len(prompts)} {args.corpus} prompts of {args.prompt_tokens} tokens")
    peers, unavailable = start_peers(args)
    try:
        tallies = measure(peers, prompts, args.temps, args.tokens, args.rounds, unavailable)
    finally:
        for p in peers:
            p.close()
    order = [(name, mode) for name in args.only for mode in PEER_CLASSES[name].modes]
    rows, ref = summarize(tallies, unavailable, order, args.temps)
    write_results(args, prompts, peers, rows, ref)
    return 0

if __name__ == "__main__":
    sys.exit(main())

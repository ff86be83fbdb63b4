"""``specdec bench-peers``: the command, the interleaved measurement, and the table."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from specdec.commands.bench.corpus import CHAT_CORPORA
from specdec.commands.bench.peers import PEER_CLASSES, PEERS
from specdec.rounds import interleaved
from specdec.commands.bench.peers.base import ModeUnavailable, Options, Tally, log

WARMUP_TOKENS = 8
Key = tuple[str, str, float]  # (peer, mode, T)
DIR = click.Path(exists=True, file_okay=False, path_type=Path)


@click.command("bench-peers")
@click.option("--target", required=True, type=click.Path(exists=True, path_type=Path),
              help="Hugging Face checkpoint folder of the target, or a GGUF file (dequantized to float32 once, into --work).")
@click.option("--draft", default=None, type=DIR, help="Checkpoint folder of a draft model (same tokenizer) for the draft-model modes of "
              "transformers, onnxruntime-genai and OpenVINO [default: none; those modes are listed as unavailable].")
@click.option("--bundle", default=None, type=DIR, help="A specdec bundle exported from --target/--draft (specdec's rows).")
@click.option("--corpus", default="code", show_default=True, type=click.Choice(["code", "stdlib", *CHAT_CORPORA]),
              help="Prompts: specdec bench's corpora; chat, chat-code, topics-*: whole held-out requests through the bundle's chat template "
                   "(--bundle needed; --prompt-tokens unused).")
@click.option("--prompts", "n_prompts", default=4, show_default=True, type=click.IntRange(1))
@click.option("--prompt-tokens", default=64, show_default=True, type=click.IntRange(1))
@click.option("--tokens", default=128, show_default=True, type=click.IntRange(2), help="New tokens per request (EOS ignored; the first closes the prefill).")
@click.option("--rounds", default=2, show_default=True, type=click.IntRange(1))
@click.option("--threads", default=2, show_default=True, type=click.IntRange(1), help="Threads of every peer (torch, ORT intra-op, OpenVINO, llama.cpp).")
@click.option("--temperatures", default="0,1", show_default=True, help="Comma-separated; 0 = greedy.")
@click.option("--only", default=",".join(PEERS), show_default=True, help="Comma-separated subset of the peers.")
@click.option("--modes", "only_modes", default=None, help="Comma-separated subset of the peers' modes, e.g. autoregressive,default,"
              "speculative-lookup [default: all].")
@click.option("--draft-tokens", default=None, type=click.IntRange(1, 16), help="Pin every speculative peer's proposal width K (genai's range) [default: each peer's own].")
@click.option("--ngram-size", default=3, show_default=True, type=click.IntRange(1), help="genai's n-gram N; openvino's and llamacpp's max_ngram_size.")
@click.option("--work", default=None, type=click.Path(file_okay=False, path_type=Path), help="Private venvs and converted models [default: $SPECDEC_CACHE/peers, else ~/.cache/specdec/peers].")
@click.option("--no-setup", "no_setup", is_flag=True, help="Create no missing venv or converted model: list those peers as unavailable.")
@click.option("--out", default=None, type=click.Path(file_okay=False, path_type=Path), help="Write results.md and results.json here.")
@click.option("--note", default="", help="A line written under the table (e.g. what else loaded the machine).")
def bench_peers_cmd(target: Path, draft: Path | None, bundle: Path | None, corpus: str, n_prompts: int, prompt_tokens: int, tokens: int,
                    rounds: int, threads: int, temperatures: str, only: str, only_modes: str | None, draft_tokens: int | None, ngram_size: int, work: Path | None, no_setup: bool,
                    out: Path | None, note: str) -> None:  # fmt: skip
    """specdec against transformers, optimum, onnxruntime-genai, OpenVINO GenAI and llama.cpp on one pair, interleaved."""
    from specdec.commands.bench.peers.venv import default_work, gguf_checkpoint
    from specdec.commands.bench.report import write_results
    from specdec.errors import ModelError

    names, wanted, temps = _selection(only, only_modes, temperatures, corpus, bundle)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # whole source files exceed model_max_length (only a prefix is used); a GGUF tokenizer's legacy notice
    work = work or default_work()
    if target.is_file():
        target = gguf_checkpoint(target, work, not no_setup)
    elif not (target / "config.json").is_file():
        raise ModelError(f"--target {target}: no config.json; expected a Hugging Face checkpoint folder or a .gguf file")
    prompts, described = _prompts(target, bundle, corpus, n_prompts, prompt_tokens, tokens)
    longest = max(map(len, prompts))
    log(described)
    options = Options(target, draft, bundle, work, threads, draft_tokens, ngram_size, longest + tokens + 64, not no_setup)
    peers, unavailable = [], {}
    for name in names:
        log(f"starting {name}")
        try:
            peers.append(PEER_CLASSES[name](options))
        except Exception as exc:  # noqa: BLE001 - a missing peer is a result
            log(f"{name} unavailable: {one_line(exc)}")
            unavailable.update({(name, m, t): one_line(exc) for m in PEER_CLASSES[name].modes for t in temps})
    unavailable.update({(p.name, m, t): "not asked (--modes)" for p in peers for m in p.modes if m not in wanted for t in temps})
    if draft is None:
        unavailable.update({(p.name, m, t): "no --draft given" for p in peers for m in p.draft_modes if m in wanted for t in temps})
    try:
        tallies = measure(peers, prompts, temps, tokens, rounds, unavailable)
    finally:
        for p in peers:
            p.close()
    rows, ref = summarize(tallies, unavailable, [(n, m) for n in names for m in PEER_CLASSES[n].modes if m in wanted], temps)
    header = (f"target {target}, draft {draft or '(none)'}: {described} x {rounds} rounds x {tokens} new tokens "
              f"(EOS ignored), {threads} threads, interleaved; tok/s = decoding after the first new token")
    settings = {p.name: p.settings for p in peers}
    md = markdown(rows, header, ref) + (f"\nNote: {note}\n" if note else "") + "\nsettings: " + json.dumps(settings) + "\n"
    click.echo(md)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in click.get_current_context().params.items()} | {"only": names, "temps": temps}
    write_results(out, md, {"config": config, "settings": settings, "prompts": prompts, "rows": rows})


def _selection(only: str, only_modes: str | None, temperatures: str, corpus: str, bundle: Path | None) -> tuple[list[str], list[str], list[float]]:
    """(peers, modes, temperatures) of --only, --modes and --temperatures, each checked."""
    from specdec.errors import InputError

    names = [p.strip() for p in only.split(",") if p.strip()]
    bad = [p for p in names if p not in PEERS]
    if bad or not names:
        raise InputError(f"--only {only!r}: unknown peer(s) {', '.join(bad) or '(none given)'}; choose from {', '.join(PEERS)}")
    names = [p for p in PEERS if p in names and (p != "specdec" or bundle is not None)]
    known = sorted({m for n in names for m in PEER_CLASSES[n].modes})
    wanted = known if only_modes is None else [m.strip() for m in only_modes.split(",") if m.strip()]
    if not wanted or (bad := [m for m in wanted if m not in known]):
        raise InputError(f"--modes {only_modes!r}: unknown mode(s) {', '.join(bad) or '(none given)'} of {', '.join(names)}; choose from {', '.join(known)}")
    try:
        temps = [float(t) for t in temperatures.split(",")]
    except ValueError:
        temps = []
    if not temps or min(temps) < 0:
        raise InputError(f"--temperatures {temperatures!r}: expected comma-separated numbers >= 0 such as 0,1")
    chat = corpus in CHAT_CORPORA
    if chat and bundle is None:
        raise InputError(f"--corpus {corpus}: chat prompts go through the bundle's chat template; give --bundle")
    return names, wanted, temps


def _prompts(target: Path, bundle: Path | None, corpus: str, n_prompts: int, prompt_tokens: int, tokens: int) -> tuple[list[list[int]], str]:
    """The prompts (the target's tokenizer, or the bundle's chat template) and a line saying what they are; checked against the target's context."""
    from specdec.commands.bench import prompts as corpus_prompts
    from specdec.errors import InputError

    chat = corpus in CHAT_CORPORA
    from transformers import AutoTokenizer

    if chat:
        from specdec.commands.bench.corpus import chat_prompts
        from specdec.manifest import load_manifest
        from specdec.runtime.text import TextCodec

        manifest = load_manifest(bundle)
        prompts = chat_prompts(bundle, manifest, TextCodec.from_bundle(bundle, manifest), CHAT_CORPORA[corpus], n_prompts)
        described = f"{len(prompts)} {corpus} requests of {min(map(len, prompts))}-{max(map(len, prompts))} tokens (chat template)"
    else:
        tok = AutoTokenizer.from_pretrained(target)  # the target's own tokenizer, special tokens as transformers adds them
        prompts = corpus_prompts(corpus, lambda text: tok(text)["input_ids"], n_prompts, prompt_tokens)
        described = f"{len(prompts)} {corpus} prompts of {prompt_tokens} tokens"
    if len(prompts) < n_prompts:
        raise InputError(f"--prompts {n_prompts}: the {corpus} corpus has only {len(prompts)} prompts" + ("" if chat else
                         f" long enough for {prompt_tokens} tokens; lower --prompts or --prompt-tokens"))
    longest = max(map(len, prompts))
    ctx = json.loads((target / "config.json").read_text()).get("max_position_embeddings")
    if ctx and longest + tokens > ctx:
        raise InputError(f"prompt ({longest} tokens) + --tokens {tokens} = {longest + tokens} exceeds the target's context ({ctx})")
    return prompts, described


def one_line(exc: Exception) -> str:
    """``Type: first line of the message`` (ModeUnavailable: the message alone)."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return text if isinstance(exc, ModeUnavailable) else f"{type(exc).__name__}: {text}"


def measure(peers: list, prompts: list[list[int]], temps: list[float], tokens: int, rounds: int, unavailable: dict[Key, str]) -> dict:
    """A warm-up per (peer, mode, T), then rounds over prompts, T, peers and modes (interleaved),
    seeded 1000 * round + prompt (as ``specdec bench``); round 0's outputs kept per prompt. A
    failing (peer, mode, T) is recorded with its first error and not asked again."""
    def attempt(peer, mode, t, prompt, n, seed):
        if (peer.name, mode, t) in unavailable:
            return None
        try:
            return peer.decode(mode, t, prompt, n, seed)
        except Exception as exc:  # noqa: BLE001 - one failing mode must not sink the others
            unavailable[(peer.name, mode, t)] = one_line(exc)
            log(f"{peer.name}/{mode}/T={t:g} unavailable: {one_line(exc)}")

    for peer, mode, t in ((p, m, t) for p in peers for m in p.modes for t in temps):
        attempt(peer, mode, t, prompts[0], WARMUP_TOKENS, 0)
    from tqdm import tqdm

    tallies: dict = {}
    cells = [(i, t, p, m) for i in range(len(prompts)) for t in temps for p in peers for m in p.modes if (p.name, m, t) not in unavailable]
    for r, (i, t, peer, mode) in tqdm(interleaved(cells, rounds), total=len(cells) * rounds, desc="[bench-peers] requests", file=sys.stderr,
                                      mininterval=5, disable=None):  # a bar with its ETA on a terminal  # fmt: skip
        if (s := attempt(peer, mode, t, prompts[i], tokens, 1000 * r + i)) is not None:
            tallies.setdefault((peer.name, mode, t), Tally()).add(s)
            if r == 0:
                tallies[(peer.name, mode, t)].outputs[i] = s.ids
    return tallies


def agree(ids: list[int] | None, ref: list[int]) -> bool:
    """The same tokens where both wrote: a peer that stopped early (transformers may end a request
    before N) agrees if its tokens are the reference's first ones."""
    n = min(len(ids or ()), len(ref))
    return n > 0 and ids[:n] == ref[:n]


def ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def summarize(tallies: dict, unavailable: dict[Key, str], order: list[tuple[str, str]], temps: list[float]) -> tuple[list[dict], str | None]:
    """One row per (peer, mode, T); at T = 0 the prompts on which it wrote exactly the tokens of the
    reference (where both wrote: ``agree``), the first autoregressive peer measured at T = 0."""
    ref = next((p for p, m in order if m == "autoregressive" and (p, m, 0.0) in tallies), None)
    want = tallies[(ref, "autoregressive", 0.0)].outputs if ref else {}
    rows = []
    for peer, mode in order:
        for t in temps:
            row: dict[str, Any] = {"peer": peer, "mode": mode, "T": t}
            tally = tallies.get((peer, mode, t))
            if (peer, mode, t) in unavailable or tally is None:
                rows.append({**row, "unavailable": unavailable.get((peer, mode, t), "no measurement")})
                continue
            base = tallies.get((peer, PEER_CLASSES[peer].baseline(mode), t))
            st, tps = tally.stats, tally.tokens / tally.seconds
            # target passes, the prefill's included: genai's verify/re-anchor passes + standard steps + prefill, else a counted one
            passes = (st["target_forward_passes"] + st["standard_fallback_steps"] + tally.requests if "target_forward_passes" in st
                      else st.get("target_passes"))
            same = sum(agree(tally.outputs.get(i), ids) for i, ids in want.items())
            row.update(tokens_per_s=tps, seconds=tally.seconds, tokens=tally.tokens, requests=tally.requests,
                       speedup=ratio(tps, base.tokens / base.seconds) if base else None,
                       tokens_per_target_pass=ratio(tally.new_tokens, passes) if passes else None,
                       acceptance=ratio(st.get("draft_tokens_accepted", 0), st.get("draft_tokens_evaluated", 0)),
                       ngram_hit_rate=ratio(st.get("ngram_lookup_hits", 0), st.get("ngram_lookup_hits", 0) + st.get("ngram_lookup_misses", 0)),
                       greedy_same_as_reference=f"{same}/{len(want)}" if t == 0 and ref else None, stats=st, outputs_round0=tally.outputs)
            rows.append(row)
    return rows, ref and f"{ref} autoregressive"


def markdown(rows: list[dict], header: str, ref: str | None) -> str:
    """The table: peer, mode, T, tok/s, speedup, tokens per target pass, acceptance, n-gram hits, agreement."""
    def fmt(x, spec):
        return "–" if x is None else format(x, spec)

    lines = [header, "", f"| peer | mode | T | tok/s | speedup vs own AR | new tokens / target pass | acceptance (accepted/evaluated) "
                         f"| n-gram hit rate | greedy = {ref or 'reference'} | notes |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "unavailable" in r:
            why = r["unavailable"].replace("|", "\\|")
            lines.append(f"| {r['peer']} | {r['mode']} | {r['T']:g} | n/a | – | – | – | – | – | unavailable: {why} |")
        else:
            lines.append(f"| {r['peer']} | {r['mode']} | {r['T']:g} | {r['tokens_per_s']:.1f} | {fmt(r['speedup'], '.2f')} | "
                         f"{fmt(r['tokens_per_target_pass'], '.2f')} | {fmt(r['acceptance'], '.3f')} | {fmt(r['ngram_hit_rate'], '.3f')} | "
                         f"{r['greedy_same_as_reference'] or '–'} | |")
    return "\n".join(lines) + "\n"


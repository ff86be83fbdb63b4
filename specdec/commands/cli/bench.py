"""``specdec bench`` (drafters and γ on one process) and ``bench-batch`` (the batched engine under
concurrent clients); ``bench-serve`` and ``bench-peers`` live with their harnesses in specdec/commands/bench/.
"""

from __future__ import annotations

from pathlib import Path

import click

from specdec.commands.bench.corpus import CHAT_CORPORA
from specdec.commands.cli.options import BUNDLE, DRAFT_PROVIDER_OPTION, PROVIDER_OPTION, parse_numbers, thread_policy
from specdec.runtime.drafters import DRAFTERS


SYNTHETIC_OPTION = click.option(
    "--synthetic-acceptance", default=None, type=float,
    help="COST ONLY: keep each draft token with this probability instead of verifying it (models whose acceptance means "
         "nothing, e.g. tools/make_sized_pair.py's); outputs are NOT the target's.")


@click.command("bench")
@click.argument("bundle", type=BUNDLE)
@click.option("--gammas", default=None, help="Comma-separated γ to run [default: 0..the bundle's γ]; 0 is always added.")
@click.option("--drafters", "--drafter", "drafters", default=None, help=f"Comma-separated drafters to compare: {', '.join(DRAFTERS)} [default: the bundle's].")
@click.option("--adaptive", is_flag=True, help="Also run each drafter with adaptive γ (gamma=auto).")
@click.option("--temperatures", default="0,1", show_default=True, help="Comma-separated sampling temperatures.")
@click.option("--prompts", "n_prompts", default=4, show_default=True, type=int, help="Prompts, from --corpus.")
@click.option("--corpus", default="stdlib", show_default=True, type=click.Choice(["stdlib", "code", "functions", "code-functions", *CHAT_CORPORA]),
              help="Prompts from held-out stdlib files, or function openings of third-party packages (numpy, click, tqdm, onnxruntime); "
                   "encoder-decoder bundles: whole functions, up to --prompt-tokens, of held-out stdlib files (functions) or those packages (code-functions); "
                   "chat models: held-out requests through the bundle's chat template, everyday (chat), coding (chat-code), or on the topics "
                   "specdec distill holds out (topics-chat, topics-code); these end at EOS or --tokens.")
@click.option("--prompt-tokens", default=64, show_default=True, type=int)
@click.option("--tokens", default=128, show_default=True, type=int, help="New tokens per request.")
@click.option("--rounds", default=2, show_default=True, type=int)
@click.option("--threads", default=None, type=int, help="ONNX Runtime intra-op threads per model session [default: one per core].")
@click.option("--out", default=None, type=click.Path(file_okay=False, path_type=Path), help="Write results.md, results.json and bench.png here.")
@click.option("--op-split", is_flag=True, help="First profile the target's calls (1 token, and a verify's k) and print where their time goes: MatMul, attention, other ops.")
@PROVIDER_OPTION
@DRAFT_PROVIDER_OPTION
@SYNTHETIC_OPTION
def bench_cmd(bundle: Path, gammas: str | None, drafters: str, adaptive: bool, temperatures: str, n_prompts: int, corpus: str,
              prompt_tokens: int, tokens: int, rounds: int, threads: int | None, out: Path | None, op_split: bool, provider: str,
              draft_provider: str | None, synthetic_acceptance: float | None) -> None:  # fmt: skip
    """Drafters and γ against γ = 0, side by side and interleaved, with Theorem 3.8's prediction."""
    from specdec.commands import bench
    from specdec.commands.bench.floor import Floor
    from specdec.commands.bench.report import write_results
    from specdec.errors import InputError
    from specdec.runtime.decoder import SpeculativeDecoder

    names = _drafter_names(drafters, (("--prompts", n_prompts), ("--prompt-tokens", prompt_tokens), ("--tokens", tokens), ("--rounds", rounds)))
    if op_split and provider != "cpu":
        raise InputError(f"--op-split profiles the CPU provider's calls; drop it with --provider {provider}")
    dec = SpeculativeDecoder.load(bundle, provider=provider, threads=thread_policy(threads), drafter=names[0] if names else None,
                                  draft_provider=draft_provider)  # fmt: skip
    names = names or [dec.drafter_spec]
    if dec.codec is None:
        raise InputError(f"bundle {bundle} has no tokenizer; specdec bench draws its prompts from text")
    decoders = _decoders(dec, names, synthetic_acceptance)
    gs = list(range(dec.manifest.gamma + 1)) if gammas is None else sorted({0, *parse_numbers("--gammas", gammas, int)})
    temps = parse_numbers("--temperatures", temperatures, float)
    seq2seq, chat = dec.manifest.seq2seq, corpus in CHAT_CORPORA
    prompts = _bench_prompts(bundle, dec, corpus, n_prompts, prompt_tokens)
    dec.request(prompts[0], max_new_tokens=tokens, gamma=max(gs))  # check the sizes before any work
    cfgs = bench.configs(names, gs, adaptive)
    splits = _op_split(bundle, dec.manifest, prompt_tokens, threads) if op_split else []
    # An encoder-decoder's shared weights file holds its encoder too, so the floor of a decoder call is not known from it
    # the floor is this CPU's memory bandwidth; a GPU's calls are bound elsewhere (docs/gpu.md)
    floor = None if seq2seq or provider != "cpu" else Floor.measure(bundle, dec.manifest, prompt_tokens + tokens // 2)
    results, text = {}, []
    for t in temps:
        rows = bench.summarize(bench.run(decoders, cfgs, prompts, tokens, rounds, t, ignore_eos=not (seq2seq or chat)), floor)
        results[f"T={t:g}"] = rows
        title = f"T={t:g}" + (f", SYNTHETIC acceptance {synthetic_acceptance:g}" if synthetic_acceptance is not None else "")
        plan = bench.planned_gamma(rows, dec.manifest.gamma, names[0])
        text.append(bench.markdown(title, rows) + (f"\nplanner's γ for {names[0]} from the measured α, c, v: {plan}\n" if plan is not None else ""))
    header = _bench_header(bundle, dec.manifest, prompts, corpus, (prompt_tokens, tokens, rounds), floor, provider, synthetic_acceptance)
    md = header + "\n" + "\n".join(text)
    click.echo(md)
    data = {**({"synthetic_acceptance": synthetic_acceptance} if synthetic_acceptance is not None else {}), **{k: bench.as_dict(v) for k, v in results.items()},
            **({"op_split": splits} if splits else {})}  # fmt: skip
    write_results(out, md, data, plot=lambda path: bench.plot(results, path))


def _drafter_names(drafters: str | None, counts) -> list[str]:
    """``bench --drafters`` as names, each checked (and the counts >= 1 before them)."""
    from specdec.errors import ConfigError, InputError

    for name, value in counts:
        if value < 1:
            raise InputError(f"{name} {value}: expected an integer >= 1")
    names = list(dict.fromkeys(d.strip() for d in (drafters or "").split(",") if d.strip()))
    for d in names or ([drafters] if drafters is not None else []):
        if d not in DRAFTERS:
            raise ConfigError(f"--drafters {drafters!r}: {d!r} is not one of {', '.join(DRAFTERS)}")
    return names


def _decoders(dec, names: list[str], synthetic_acceptance: float | None) -> dict:
    """A decoder per drafter, the first ``dec`` itself and the others its forks (cost only under ``synthetic_acceptance``)."""
    decoders = {names[0]: dec, **{d: dec.fork(drafter=d) for d in names[1:]}}
    if synthetic_acceptance is not None:
        from specdec.commands.bench.synthetic import enable

        for d in decoders.values():
            enable(d, synthetic_acceptance)
    return decoders


def _bench_prompts(bundle: Path, dec, corpus: str, n_prompts: int, prompt_tokens: int) -> list[list[int]]:
    """``bench --corpus``'s prompts for this bundle (sources for an encoder-decoder, chat turns through its template)."""
    from specdec.commands import bench
    from specdec.commands.bench.corpus import SOURCE_CORPORA
    from specdec.errors import InputError

    seq2seq = dec.manifest.seq2seq
    if seq2seq != (corpus in SOURCE_CORPORA):
        raise InputError(f"--corpus {corpus}: " + ("an encoder-decoder bundle takes --corpus functions or code-functions (whole functions as sources)" if seq2seq
                                                  else "whole functions are sources for encoder-decoder bundles; use stdlib or code"))  # fmt: skip
    if corpus in CHAT_CORPORA:
        from specdec.commands.bench.corpus import chat_prompts

        prompts = chat_prompts(bundle, dec.manifest, dec.codec, CHAT_CORPORA[corpus], n_prompts)
    else:
        prompts = bench.prompts(corpus, dec.codec.encode, n_prompts, prompt_tokens)
    if not prompts:
        raise InputError(f"found no {corpus} prompt of {prompt_tokens} tokens (with as many after it); lower --prompt-tokens")
    return prompts


def _op_split(bundle: Path, m, prompt_tokens: int, threads: int | None) -> list[dict]:
    """``bench --op-split``: where the target's 1-token and k-token calls spend their time, printed and returned."""
    from specdec.errors import InputError

    if m.seq2seq:
        raise InputError("--op-split profiles a decoder-only target's calls; this bundle is an encoder-decoder")
    from specdec.commands.bench.opsplit import profile_calls

    splits = []
    for k in sorted({1, m.k}):
        split = profile_calls(bundle, m, "target", tokens=k, calls=24, context=min(prompt_tokens, m.max_seq_len - 25 * k), threads=thread_policy(threads))
        splits.append(split.as_dict())
        click.echo("\n".join(split.lines()) + "\n")
    return splits


def _bench_header(bundle: Path, m, prompts, corpus: str, sizes: tuple[int, int, int], floor, provider: str, synthetic_acceptance: float | None) -> str:
    """The lines above ``specdec bench``'s tables: the pair, the prompts, what α, c and the floor are."""
    from specdec.commands.bench.corpus import CODE_PACKAGES

    prompt_tokens, tokens, rounds = sizes
    seq2seq, chat = m.seq2seq, corpus in CHAT_CORPORA
    draft = f"draft {m.draft.parameters / 1e6:.2f}M" if m.draft else "no draft model"
    header = (
        f"bundle {bundle}: target {m.target.parameters / 1e6:.1f}M, {draft} params, {m.dtype}; "
        + (f"{len(prompts)} sources (whole functions of {'held-out stdlib files' if corpus == 'functions' else ', '.join(CODE_PACKAGES)}) of {min(map(len, prompts))}-{max(map(len, prompts))} tokens "
           f"x {rounds} rounds x up to {tokens} new tokens per configuration, interleaved; " if seq2seq else
           f"{len(prompts)} held-out requests ({corpus}, through the chat template) of {min(map(len, prompts))}-{max(map(len, prompts))} tokens x {rounds} rounds "
           f"x up to {tokens} new tokens (to EOS) per configuration, interleaved; " if chat else
           f"{len(prompts)} held-out prompts ({corpus}) of {prompt_tokens} tokens x {rounds} rounds x {tokens} new tokens per configuration, interleaved; ")
        + "α is the maximum-likelihood estimate from accepted and rejected drafts, c is per drafted token\n"
        + (f"{floor.line()}; × bandwidth floor = decode time / the floor of the calls it made (specdec/commands/bench/floor.py)\n" if floor else
           "sources encoded once per request by both encoders (prefill); requests end at EOS or --tokens\n" if seq2seq else
           f"provider {provider}: no bandwidth floor (it is this CPU's memory bandwidth)\n")
    )  # fmt: skip
    if synthetic_acceptance is not None:
        from specdec.commands.bench.synthetic import banner

        header = banner(synthetic_acceptance) + header
    return header


@click.command("bench-batch")
@click.argument("bundle", type=BUNDLE)
@click.option("--concurrency", default="1,2,4,8,16", show_default=True, help="Comma-separated numbers of concurrent clients.")
@click.option("--temperatures", default="0,1", show_default=True, help="Comma-separated sampling temperatures.")
@click.option("--requests", default=2, show_default=True, type=int, help="Requests per client per configuration.")
@click.option("--prompt-tokens", default=64, show_default=True, type=int)
@click.option("--tokens", default=128, show_default=True, type=int, help="New tokens per request.")
@click.option("--threads", default=None, type=int, help="ONNX Runtime intra-op threads per model session [default: one per core].")
@click.option("--timeout", default=300.0, show_default=True, type=float, help="Seconds a configuration may run before its clients stop.")
@click.option("--out", default=None, type=click.Path(file_okay=False, path_type=Path), help="Write results.md, results.json and load.png here.")
@SYNTHETIC_OPTION
def bench_batch_cmd(bundle: Path, concurrency: str, temperatures: str, requests: int, prompt_tokens: int, tokens: int,
                    threads: int | None, timeout: float, out: Path | None, synthetic_acceptance: float | None) -> None:  # fmt: skip
    """The batched engine under N concurrent clients: adaptive, fixed and no speculation, and fork per thread."""
    from specdec.commands.bench import held_out_prompts
    from specdec.commands.bench.load import markdown, plot, sweep
    from specdec.commands.bench.report import write_results
    from specdec.errors import InputError
    from specdec.manifest import load_manifest
    from specdec.runtime.text import TextCodec

    counts = parse_numbers("--concurrency", concurrency, int)
    for name, value in (("--requests", requests), ("--prompt-tokens", prompt_tokens), ("--tokens", tokens), *(("--concurrency", c) for c in counts)):
        if value < 1:
            raise InputError(f"{name} {value}: expected an integer >= 1")
    m = load_manifest(bundle)
    codec = TextCodec.from_bundle(bundle, m)
    if codec is None:
        raise InputError(f"bundle {bundle} has no tokenizer; specdec bench-batch draws its prompts from text")
    prompts = held_out_prompts(codec.encode, 8, prompt_tokens)
    if synthetic_acceptance is not None:
        from specdec.commands.bench.synthetic import check_rate

        check_rate(synthetic_acceptance)
    rows = sweep(bundle, counts, parse_numbers("--temperatures", temperatures, float), prompts, tokens, requests, thread_policy(threads), timeout,
                 report=lambda r: click.echo(f"{r['mode']:>18} clients={r['concurrency']:<3} T={r['temperature']:g}: {r['tok_s']:.0f} tok/s", err=True),
                 synthetic=synthetic_acceptance)  # fmt: skip
    header = (f"bundle {bundle}: max-batch {m.max_batch}, γ {m.gamma}; {requests} requests per client of {prompt_tokens} prompt + {tokens} new "
              "tokens (held-out stdlib prompts), EOS ignored; modes interleaved at each concurrency")
    if synthetic_acceptance is not None:
        from specdec.commands.bench.synthetic import banner

        header = banner(synthetic_acceptance) + header
    md = markdown(rows, header)
    click.echo(md)
    write_results(out, md, rows, plot=lambda path: plot(rows, path.with_name("load.png")))

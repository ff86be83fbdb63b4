"""``specdec generate``: decode with a bundle (sampling, constraints, beam search).
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from specdec.commands.cli.options import BUNDLE, DRAFT_PROVIDER_OPTION, PROVIDER_OPTION, parse_gamma, text_or_ids, thread_policy
from specdec.runtime.drafters import DRAFTERS


@click.command("generate")
@click.argument("bundle", type=BUNDLE)
@click.option("--prompt", default=None, help="Prompt text (needs the bundle's tokenizer).")
@click.option("--prompt-ids", default=None, help="Prompt token ids, comma-separated: 1,2,3.")
@click.option("--source", default=None, help="Encoder-decoder bundles: the source text (--prompt is then a decoder prefix).")
@click.option("--source-ids", default=None, help="Encoder-decoder bundles: source token ids, comma-separated.")
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--top-k", default=None, type=int, help="Keep the k most likely tokens (0 or unset = off).")
@click.option("--top-p", default=None, type=float, help="Nucleus mass in (0, 1] (unset = off).")
@click.option("--min-p", default=0.0, show_default=True, type=float, help="Drop tokens less likely than this fraction of the most likely (0 = off).")
@click.option("--repetition-penalty", default=1.0, show_default=True, type=float, help="> 1 discourages tokens of the prompt and the output (1 = off).")
@click.option("--presence-penalty", default=0.0, show_default=True, type=float, help="-2..2, subtracted from tokens already generated (0 = off).")
@click.option("--frequency-penalty", default=0.0, show_default=True, type=float, help="-2..2, times each token's count so far (0 = off).")
@click.option("--seed", default=None, type=int, help="Makes sampling reproducible.")
@click.option("--gamma", default=None, help="Draft tokens per target call, 0..bundle gamma [default: the bundle's]; 0 = no draft; auto = chosen each step from the measured acceptance and cost.")
@click.option("--drafter", default=None, type=click.Choice(list(DRAFTERS)), help="What proposes tokens: the draft model, the feature head (alone, as a tree, or after prompt lookup), "
              "a bigram or unigram table, prompt lookup, or the draft model sped up by prompt lookup [default: the bundle's, see specdec inspect].")
@click.option("--lookup-ngram", default=3, show_default=True, type=int, help="Prompt lookup: longest suffix n-gram matched (down to 1).")
@click.option("--lookup-max-tokens", default=None, type=int, help="Prompt lookup: most tokens copied per call [default: gamma].")
@click.option("--lenience", default=1.0, show_default=True, type=float, help="1 = exact. Below 1 accepts more drafts and CHANGES the output distribution (no token above p/lenience; paper App. A.5).")
@click.option("--ignore-eos", is_flag=True, help="Keep going past end-of-sequence tokens.")
@PROVIDER_OPTION
@DRAFT_PROVIDER_OPTION
@click.option("--verify", default="full", show_default=True, type=click.Choice(["full", "size"]),
              help="Check the bundle's files: full digests (once per unchanged file), or sizes only for a bundle you trust (changed bytes would run as another model).")
@click.option("--threads", default=None, type=int, help="ONNX Runtime intra-op threads per model session [default: one per core].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with tokens, text and stats.")
@click.option("--num-beams", default=1, show_default=True, type=int,
              help="Beam search of this width (Hugging Face's semantics; deterministic). Plain unless --gamma > 0: then the draft's beams "
                   "are verified several steps a target call (paper App. A.4), the same result; it pays only where target calls are memory-bound.")  # fmt: skip
@click.option("--draft-width", default=None, type=int, help="Beam search: the draft's beam width u [default: --num-beams].")
@click.option("--length-penalty", default=1.0, show_default=True, type=float, help="Beam search: scores are divided by length ** this.")
@click.option("--early-stopping", default="false", show_default=True, type=click.Choice(["true", "false", "never"]),
              help="Beam search: stop when num-beams beams finished (true), when none can improve (false), or never before max length.")
@click.option("--num-return-sequences", default=1, show_default=True, type=int, help="Beam search: the best this many, one per line.")
@click.option("--json-schema", "json_schema", default=None, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Hold the output to this JSON schema (a .json file); exact under speculation.")
@click.option("--json-object", is_flag=True, help="Hold the output to any JSON object.")
@click.option("--regex", default=None, help="Hold the output to this regular expression.")
@click.option("--choice", "choices", multiple=True, help="The output is one of these strings (repeat the option for each).")
@click.option("--grammar", default=None, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Hold the output to this grammar file: Lark (as llguidance reads it) or GBNF (llama.cpp's).")
def generate_cmd(bundle: Path, prompt: str | None, prompt_ids: str | None, source: str | None, source_ids: str | None, provider: str,
                 draft_provider: str | None, verify: str, threads: int | None, as_json: bool, drafter: str, lookup_ngram: int, lookup_max_tokens: int | None, gamma: str | None,
                 num_beams: int, draft_width: int | None, length_penalty: float, early_stopping: str, num_return_sequences: int,
                 json_schema: Path | None, json_object: bool, regex: str | None, choices: tuple[str, ...], grammar: Path | None,
                 **kw) -> None:  # fmt: skip
    """Decode with a bundle: text (or token ids) to stdout as accepted, a stats line to stderr.

    An encoder-decoder bundle (T5, BART, Marian) takes --source (or --prompt as its source).
    With --num-beams > 1, beam search: the best sequences, one per line, when it ends."""
    from specdec.errors import InputError
    from specdec.runtime.decoder import SpeculativeDecoder
    from specdec.runtime.drafters import LookupDrafter
    from specdec.runtime.params import BeamParams, SamplingParams

    structured = _structured(json_schema, json_object, regex, choices, grammar)
    params = SamplingParams(gamma=parse_gamma(gamma), structured_outputs=structured, **kw)  # the other options map one to one onto its fields
    prompt = text_or_ids("--prompt", prompt, prompt_ids)
    source = text_or_ids("--source", source, source_ids)
    if prompt is None and source is None:
        raise InputError("give exactly one of --prompt TEXT and --prompt-ids 1,2,3 (an encoder-decoder bundle: --source TEXT or --source-ids 1,2,3)")
    beam_only = {"--draft-width": draft_width is not None, "--length-penalty": length_penalty != 1.0, "--early-stopping": early_stopping != "false",
                 "--num-return-sequences": num_return_sequences != 1}  # fmt: skip
    if num_beams != 1 or any(beam_only.values()):
        beams = BeamParams(num_beams, params.max_new_tokens, length_penalty, {"true": True, "false": False}.get(early_stopping, early_stopping),
                           num_return_sequences, params.ignore_eos, params.stop_token_ids, 0 if gamma is None else _int_gamma(gamma), draft_width)  # fmt: skip
        return _beam_search(bundle, prompt, source, beams, params, drafter, provider, threads, verify, as_json)
    lookup = LookupDrafter(max_ngram=lookup_ngram, max_tokens=lookup_max_tokens)  # checked whatever the drafter
    spec = lookup if drafter == "lookup" else drafter
    dec = SpeculativeDecoder.load(bundle, provider=provider, threads=thread_policy(threads), drafter=spec, verify=verify, draft_provider=draft_provider)
    stream = dec.stream(prompt, params, source=source)
    for piece in stream:
        if not as_json:
            out = piece.text if piece.text is not None else "".join(f"{t} " for t in piece.tokens)
            click.echo(out, nl=False)
    res = stream.result
    if as_json:
        click.echo(json.dumps({"tokens": res.tokens, "text": res.text, "stats": res.stats.as_dict()}))
    else:
        click.echo("")
        click.echo(res.stats.line(), err=True)


def _structured(json_schema: Path | None, json_object: bool, regex: str | None, choices: tuple[str, ...], grammar: Path | None):
    """``generate``'s constraint options as a ``StructuredOutputs`` (at most one), or None."""
    from specdec.errors import InputError
    from specdec.runtime.constraints import StructuredOutputs

    given = {"--json-schema": json_schema is not None, "--json-object": json_object, "--regex": regex is not None, "--choice": bool(choices),
             "--grammar": grammar is not None}  # fmt: skip
    named = [k for k, v in given.items() if v]
    if not named:
        return None
    if len(named) > 1:
        raise InputError(f"{' and '.join(named)}: give one constraint at a time")
    if json_schema is not None:
        try:
            schema = json.loads(json_schema.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise InputError(f"--json-schema {json_schema}: not a JSON file ({str(e).splitlines()[0]}); pass a JSON schema file") from None
        return StructuredOutputs(json=schema)
    if grammar is not None:
        return StructuredOutputs(grammar=grammar.read_text())
    return StructuredOutputs(json_object=json_object, regex=regex, choice=choices or None)


def _int_gamma(gamma: str) -> int:
    """A beam search's --gamma: a fixed number of draft steps, not auto."""
    from specdec.errors import ConfigError

    if gamma == "auto":
        raise ConfigError("--gamma auto: beam search takes a fixed number of draft steps (0..the bundle's gamma), not auto")
    return parse_gamma(gamma, auto=False)


def _beam_search(bundle: Path, prompt, source, beams, params, drafter: str, provider: str, threads: int | None, verify: str, as_json: bool) -> None:
    """``generate --num-beams``: refuse the sampling options beam search does not use, then print the best sequences."""
    from specdec.errors import InputError
    from specdec.runtime.decoder import SpeculativeDecoder
    from specdec.runtime.params import SamplingParams

    used = {"max_new_tokens", "ignore_eos", "stop_token_ids", "gamma"}
    default = SamplingParams()
    for name in SamplingParams.names():
        if name not in used and getattr(params, name) != getattr(default, name):
            flag = "--" + name.replace("_", "-")
            raise InputError(f"{flag} {getattr(params, name)}: beam search is deterministic and takes no sampling options; drop it or pass --num-beams 1")
    if drafter not in (None, "model"):
        raise InputError(f"--drafter {drafter}: beam search drafts with the draft model's own beams; drop --drafter or pass --num-beams 1")
    dec = SpeculativeDecoder.load(bundle, provider=provider, threads=thread_policy(threads), drafter="lookup", verify=verify)  # model-free: the beam runner opens the draft's graphs it needs
    res = dec.beam_search(prompt, beams, source=source)
    s = res.stats
    if as_json:
        seqs = [{"tokens": b.tokens, "text": b.text, "score": b.score} for b in res.sequences]
        click.echo(json.dumps({"sequences": seqs, "stats": {"steps": s.steps, "rounds": s.rounds, "target_calls": s.target_calls,
                                                             "draft_calls": s.draft_calls, "seconds": s.total_seconds}}))  # fmt: skip
        return
    for b in res.sequences:
        click.echo(b.text if b.text is not None else " ".join(map(str, b.tokens)))
    click.echo(f"{len(res.sequences)} of {beams.num_beams} beams | {s.steps} steps in {s.rounds} target rounds ({s.mean_steps:.2f} a round) | "
               f"{s.target_calls} target calls, {s.draft_calls} draft calls | {s.total_seconds:.2f} s", err=True)  # fmt: skip

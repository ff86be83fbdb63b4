"""Drafters from the target: ``specdec distill`` (its answers) and ``specdec train-drafter`` (a feature head).
"""

from __future__ import annotations

from pathlib import Path

import click

from specdec.commands.distill.prompts import FORM_SETS
from specdec.errors import ConfigError


@click.command("train-drafter")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--corpus", default="stdlib", show_default=True, help="'stdlib' (the demo pair's training files), a `specdec distill` folder "
              "(the target's own answers; 1 topic in 32 held out), or a folder of text files (every 20th held out).")
@click.option("--steps", default=600, show_default=True, type=click.IntRange(1), help="Optimizer steps.")
@click.option("--batch", default=8, show_default=True, type=click.IntRange(1), help="Windows per step.")
@click.option("--window", default=256, show_default=True, type=click.IntRange(8), help="Tokens per training window.")
@click.option("--windows", default=1200, show_default=True, type=click.IntRange(1), help="Training windows, or conversations at most from a distill "
              "folder (the target's features are computed once for them).")
@click.option("--lr", default=2e-3, show_default=True, type=click.FloatRange(0, min_open=True), help="Peak learning rate (cosine schedule).")
@click.option("--noise", default=0.1, show_default=True, type=click.FloatRange(0), help="Uniform noise on the input features, relative to their RMS.")
@click.option("--unroll", default=1, show_default=True, type=click.IntRange(1, 4), help="Passes over the head's own features per step (EAGLE-3's training-time test).")
@click.option("--draft-vocab", default=None, type=click.IntRange(1), help="Draft over the N most frequent training tokens only: an N/V-sized LM head "
              "(EAGLE-3's reduced vocabulary); other tokens still come from the target [default: the whole vocabulary].")
@click.option("--bf16", is_flag=True, help="bfloat16 autocast for the training passes (several times faster on CPUs with AMX or "
              "AVX-512 BF16); held-out figures stay float32.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--save", default=None, type=click.Path(file_okay=False, path_type=Path), help="Also save the head as a checkpoint folder (specdec-export --feature-drafter reads it).")
@click.option("--save-format", type=click.Choice(["specdec", "speculators"]), default="specdec", show_default=True,
              help="speculators: train an EAGLE-3 head (fused features of the target's auxiliary layers) that vLLM's Speculators, "
                   "and what reads its format, load; --save writes it in Speculators' layout.")
@click.option("--aux-layers", default=None, help="With --save-format speculators: comma-separated target layers the head's fc reads "
              "(the residual stream entering each; the layer count: the final norm's input) [default: 2, L/2, L-3].")
@click.option("--checkpoint", default=None, type=click.Path(dir_okay=False, path_type=Path), help="Keep the training state in this file (every "
              "10 minutes, on Ctrl-C, at the end); the same command with the same file goes on where it stopped, so several runs add up to one schedule.")
@click.option("--train-minutes", default=None, type=click.FloatRange(0, min_open=True), help="Train at most this long: with --checkpoint this run "
              "stops there and the next goes on; without, the step count is fit into the time (at most --steps).")
def train_drafter_cmd(bundle: Path, corpus: str, steps: int, batch: int, window: int, windows: int, lr: float, noise: float, unroll: int,
                      draft_vocab: int | None, bf16: bool, seed: int, save: Path | None, save_format: str, aux_layers: str | None,
                      checkpoint: Path | None, train_minutes: float | None) -> None:  # fmt: skip
    """Train a feature drafter (EAGLE-style head) for BUNDLE's target and write it into BUNDLE.

    Adds the features output to the target's graphs and a head graph; the bundle is re-hashed
    and replaced only when all of it passed. Then decode with --drafter feature."""
    from specdec.manifest import load_manifest

    load_manifest(bundle)  # a bad bundle fails in one line before torch loads
    try:
        from specdec.export.train_head import Recipe, train
    except ImportError as e:
        raise ConfigError(f"train-drafter needs the export extra ({e.name} is missing): pip install torch==2.13.0 -e '.[export]'") from None
    recipe = Recipe(steps=steps, batch=batch, window=window, windows=windows, lr=lr, noise=noise, unroll=unroll, draft_vocab=draft_vocab, bf16=bf16, seed=seed)
    report = lambda line: click.echo(line, err=True)  # noqa: E731
    seconds = None if train_minutes is None else 60 * train_minutes
    if save_format == "speculators":
        from specdec.export.eagle3_train import train_eagle3

        record = train_eagle3(bundle, corpus, recipe, save, report, _layer_ids(aux_layers), checkpoint, seconds)
    elif aux_layers is not None:
        raise ConfigError(f"--aux-layers {aux_layers}: only an EAGLE-3 head reads auxiliary layers; add --save-format speculators")
    else:
        record = train(bundle, corpus, recipe, save, report, checkpoint, seconds)
    after = record["held_out"]["after"]
    left = "" if record["steps_done"] >= record["steps"] else f"; {record['steps_done']}/{record['steps']} steps: the same command goes on from {checkpoint}"
    click.echo(f"feature drafter written into {bundle}: held-out α(T=1) {after['alpha_t1']}, argmax agreement {after['argmax_t0']} "
               f"({record['data_seconds']:.0f} s data, {record['train_seconds']:.0f} s training){left}")  # fmt: skip


def _layer_ids(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--aux-layers {text}: expected comma-separated layer ids, e.g. 2,12,27") from None


@click.command("distill")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="Data folder; a run there resumes where it stopped.")
@click.option("--tokens", default=None, type=click.IntRange(1), help="Stop at this many answer tokens in the folder [default: every prompt answered].")
@click.option("--minutes", default=None, type=click.FloatRange(0, min_open=True), help="Stop after this many minutes (whole shards are kept).")
@click.option("--max-batch", default=None, type=click.IntRange(1), help="Requests decoded together [default: the bundle's max batch].")
@click.option("--max-new-tokens", default=256, show_default=True, type=click.IntRange(1), help="Longest answer.")
@click.option("--temperatures", default="0,1", show_default=True, help="Comma-separated: each prompt is answered once at each.")
@click.option("--docs", default=1500, show_default=True, type=click.IntRange(0), help="Coding requests made from installed packages' docstrings.")
@click.option("--forms", default="templates", show_default=True, type=click.Choice(list(FORM_SETS)),
              help="Request forms: instructions about a topic ('Explain X to a beginner.'), or the direct questions of everyday chat "
                   "('What should I know about X?', several self-instruct asks per topic), or user turns the target writes whole from its "
                   "chat template (user-turns, Magpie), or everyday requests of many shapes (everyday: 'Make a checklist for X.', 'Write a "
                   "limerick about X.', 'How does X work?'); a second folder of another kind adds to a corpus (specdec distill-merge).")  # fmt: skip
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option("--plan-only", is_flag=True, help="Make the plan and write the prompts' ids (prompts.npz), then stop: for answering elsewhere (tools/gpu/drafter.py).")
def distill_cmd(bundle: Path, out: Path, tokens: int | None, minutes: float | None, max_batch: int | None, max_new_tokens: int,
                temperatures: str, docs: int, forms: str, seed: int, no_progress: bool, plan_only: bool) -> None:  # fmt: skip
    """Self-distillation: BUNDLE's target answers varied prompts (topics × forms, questions it
    writes itself, coding requests from installed docs) through its chat template; the answers
    and their top-20 log-probabilities go to --out for specdec train-drafter --corpus.

    Resumable: run the same command again to continue. Held-out topics never enter (see
    specdec/commands/distill/prompts.py)."""
    from specdec.commands.distill.run import Settings, distill
    from specdec.manifest import load_manifest

    m = load_manifest(bundle)
    try:
        temps = tuple(float(t) for t in temperatures.split(","))
    except ValueError:
        raise ConfigError(f"--temperatures {temperatures!r}: expected comma-separated numbers, e.g. 0,1") from None
    if not temps or any(t < 0 for t in temps):
        raise ConfigError(f"--temperatures {temperatures!r}: expected numbers >= 0, e.g. 0,1")
    settings = Settings(max_new_tokens=max_new_tokens, temperatures=temps, seed=seed, docs=docs, forms=forms)
    if plan_only:
        from specdec.commands.distill.run import plan_only as make

        make(bundle, out, settings, max_batch or m.max_batch, report=lambda line: click.echo(line, err=True))
        return
    record = distill(bundle, out, settings, max_batch or m.max_batch, tokens, minutes, progress=not no_progress,
                     report=lambda line: click.echo(line, err=True))  # fmt: skip
    r = record["this_run"]
    click.echo(f"{out}: {record['answers']} answers, {record['answer_tokens']:,} answer tokens of {record['jobs']} jobs; "
               f"this run {r['answer_tokens']:,} tokens in {r['seconds']:.0f} s ({r['tok_s']} tok/s)"
               + ("; interrupted: run the same command to resume" if record["interrupted"] else ""))  # fmt: skip


@click.command("distill-merge")
@click.argument("sources", nargs=-1, required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="A new folder.")
def distill_merge_cmd(sources: tuple[Path, ...], out: Path) -> None:
    """Merge `specdec distill` folders SOURCES into one corpus --out: the first keeps its job numbers
    (a features cache made for it stays valid), the others' answered requests are appended
    (specdec/commands/distill/merge.py). Prints the merge's JSON record."""
    import json

    from specdec.commands.distill.merge import merge

    if len(sources) < 2:
        raise ConfigError("distill-merge: expected at least two folders, the first keeping its job numbers")
    click.echo(json.dumps(merge(list(sources), out), indent=1))

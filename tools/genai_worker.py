#!/usr/bin/env python3
"""onnxruntime-genai worker for ``tools/bench_peers.py`` (its ``genai`` peer).

Runs under the genai venv's python (``.bench/genai-venv/bin/python``) and needs only the
standard library, numpy and onnxruntime_genai::

    genai_worker.py '{"pair": DIR, "threads": N, "k": K, "ngram_size": N}'

``DIR`` is the folder ``peers.genai.genai_models`` writes (``target/``, ``draft/`` and a composite
speculative ``genai_config.json``). The protocol (JSON lines: ``hello``, ``decode``) is
``jsonl_worker``'s.

Modes: ``autoregressive``, ``speculative-draft``, ``speculative-ngram``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from jsonl_worker import redirect_stdout, serve

SPEC_STATS = ("draft_tokens_proposed", "draft_tokens_evaluated", "draft_tokens_accepted", "target_forward_passes",
              "standard_fallback_steps", "draft_forward_passes", "rounds", "ngram_lookup_hits", "ngram_lookup_misses")


def genai_load(og, folder: Path, threads: int, with_draft: bool):
    """An ``og.Model`` with every session's intra-op threads set (a config overlay)."""
    config = og.Config(str(folder))
    blocks = ("decoder", "draft") if with_draft else ("decoder",)
    config.overlay(json.dumps({"model": {b: {"session_options": {"intra_op_num_threads": threads}} for b in blocks}}))
    return og.Model(config)


def genai_decode(og, model, mode: str, temperature: float, prompt: list[int], tokens: int, seed: int,
                 k: int, ngram_size: int) -> dict:
    """One request through ``og.Generator``; times decoding after the first token is out."""
    import numpy as np

    params = og.GeneratorParams(model)
    total = len(prompt) + tokens
    search: dict[str, Any] = dict(max_length=total, min_length=total, do_sample=temperature > 0)
    if temperature > 0:
        search.update(temperature=temperature, top_k=0, top_p=1.0, random_seed=seed)  # top_k 0: full vocabulary
    params.set_search_options(**search)
    speculative = mode != "autoregressive"
    if mode == "speculative-ngram":
        params.set_speculative_options(ngram_size=ngram_size, max_draft_tokens=k)
    elif mode == "speculative-draft":
        params.set_speculative_options(max_draft_tokens=k)
    gen = og.Generator(model, params)
    gen.append_tokens(np.asarray([prompt], dtype=np.int32))
    gen.generate_next_token()
    t_first = time.perf_counter()
    out_first = 1 + (int(gen.get_speculative_stats().get("tokens_buffered", 0)) if speculative else 0)
    while not gen.is_done():
        gen.generate_next_token()
    t_end = time.perf_counter()
    ids = gen.get_sequence(0)[len(prompt):].tolist()
    stats = {}
    if speculative:
        got = gen.get_speculative_stats()
        stats = {key: float(got.get(key, 0)) for key in SPEC_STATS}
    return {"seconds": t_end - t_first, "tokens": len(ids) - out_first, "new_tokens": len(ids), "stats": stats, "ids": ids}


def load_models(og, pair: Path, threads: int) -> tuple[dict[str, Any], dict[str, str]]:
    """The plain target (autoregressive and n-gram modes) and the composite speculative model
    (draft mode), and for each mode that cannot load, the reason."""
    unavailable: dict[str, str] = {}
    models: dict[str, Any] = {}
    try:
        models["autoregressive"] = models["speculative-ngram"] = genai_load(og, pair / "target", threads, False)
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        for m in ("autoregressive", "speculative-ngram"):
            unavailable[m] = f"target did not load: {exc}"
    if not hasattr(og.GeneratorParams, "set_speculative_options"):
        for m in ("speculative-draft", "speculative-ngram"):
            unavailable[m] = f"onnxruntime-genai {og.__version__} has no GeneratorParams.set_speculative_options"
    else:
        try:
            models["speculative-draft"] = genai_load(og, pair, threads, True)
        except Exception as exc:  # noqa: BLE001
            unavailable["speculative-draft"] = f"composite speculative model did not load: {exc}"
    return models, unavailable


def main(spec: dict) -> int:
    """Load the models, then serve ``hello`` and ``decode`` requests until stdin closes."""
    reply = redirect_stdout()  # anything the library prints goes to stderr, not into the replies
    import onnxruntime_genai as og

    models, unavailable = load_models(og, Path(spec["pair"]), spec["threads"])
    hello = {"version": og.__version__, "unavailable": unavailable}
    return serve(reply, lambda: hello, lambda req: genai_decode(
        og, models[req["mode"]], req["mode"], req["temperature"], req["prompt"], req["tokens"], req["seed"],
        spec["k"], spec["ngram_size"]))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(json.loads(sys.argv[1])))

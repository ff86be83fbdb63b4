#!/usr/bin/env python3
"""llama.cpp worker (through llama-cpp-python) for ``tools/bench_peers.py`` (its ``llamacpp`` peer).

Runs under the llama.cpp venv's python (``.bench/llamacpp-venv/bin/python``) and needs only the
standard library, numpy and llama_cpp::

    llamacpp_worker.py '{"gguf": {"f32": FILE, "q8_0": FILE}, "threads": N, "k": K, "ngram_size": N, "n_ctx": C}'

The protocol is ``jsonl_worker``'s. Modes, per precision (F32 unsuffixed, Q8_0 as ``-q8_0``):

* ``autoregressive``      ``Llama`` alone;
* ``speculative-lookup``  ``Llama(draft_model=LlamaPromptLookupDecoding(max_ngram_size=N,
                          num_pred_tokens=K))``: the binding's prompt lookup; its ``generate``
                          evaluates [last token, proposals] in one call and keeps the prefix
                          that its sampler reproduces (at T = 0 exactly greedy; at T > 0 each
                          kept token is one the target sampled);
* ``speculative-draft``   listed unavailable: the binding has no draft-model drafter (below).

Requests go through ``Llama.generate`` with the prompt as token ids after ``reset()`` (no
prompt cache carried between requests). ``generate`` never stops on EOS by itself (stopping
is ``create_completion``'s), so EOS is ignored by taking exactly ``tokens`` tokens from it.
Greedy at T = 0 (``temp = 0``: llama.cpp's greedy sampler); at T > 0 ``temp = T``, ``top_k = 0``,
``top_p = 1``, ``min_p = 0``, ``typical_p = 1``, ``repeat_penalty = 1`` (no filter, no penalty),
seeded with ``set_seed(seed)``. Timing: from the first token out of ``generate`` (prefill done)
to the last, counting the tokens after the first, as the other peers' streamer clocks do.
Target passes are the ``eval`` calls (the prefill's included); in lookup mode the proposals'
lengths are counted, and accepted = new tokens - passes (each pass yields its accepted
proposals plus one token).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from jsonl_worker import redirect_stdout, serve

BASE_MODES = ("autoregressive", "speculative-lookup")
NO_DRAFT_MODEL = ("llama-cpp-python has no draft-model drafter: Llama(draft_model=) takes a LlamaDraftModel and the "
                  "only one it ships is LlamaPromptLookupDecoding (llama.cpp's own draft-model speculation is not bound)")


def mode_name(base: str, precision: str) -> str:
    return base if precision == "f32" else f"{base}-{precision}"


def counting_lookup(llama_speculative, ngram: int, k: int):
    """A LlamaPromptLookupDecoding that also counts the tokens it proposes."""

    class CountingLookup(llama_speculative.LlamaPromptLookupDecoding):
        proposed = 0

        def __call__(self, input_ids, /, **kwargs):
            out = super().__call__(input_ids, **kwargs)
            self.proposed += len(out)
            return out

    return CountingLookup(max_ngram_size=ngram, num_pred_tokens=k)


class Runner:
    """One ``Llama`` (and its lookup drafter, if any) whose ``eval`` calls are counted."""

    def __init__(self, llama_cpp, path: str, spec: dict, lookup: bool) -> None:
        from llama_cpp import llama_speculative

        self.drafter = counting_lookup(llama_speculative, int(spec["ngram_size"]), int(spec["k"])) if lookup else None
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=int(spec["n_ctx"]), n_threads=int(spec["threads"]),
                                   n_threads_batch=int(spec["threads"]), draft_model=self.drafter, verbose=False)
        self.passes = 0
        eval_tokens = self.llm.eval

        def counted_eval(tokens) -> None:  # an instance attribute: generate's self.eval finds it
            self.passes += 1
            eval_tokens(tokens)

        self.llm.eval = counted_eval

    def decode(self, temperature: float, prompt: list[int], tokens: int, seed: int) -> dict:
        sampling: dict[str, Any] = {"temp": 0.0} if temperature == 0 else {
            "temp": float(temperature), "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0}
        self.llm.reset()
        self.llm.set_seed(int(seed))
        self.passes = 0
        proposed0 = self.drafter.proposed if self.drafter else 0
        out: list[int] = []
        gen = self.llm.generate(prompt, repeat_penalty=1.0, **sampling)
        t_first = 0.0
        for tok in gen:
            if not out:
                t_first = time.perf_counter()
            out.append(int(tok))
            if len(out) == tokens:
                break
        t_end = time.perf_counter()
        gen.close()
        stats = {"target_passes": float(self.passes)}
        if self.drafter is not None:
            stats.update(draft_tokens_evaluated=float(self.drafter.proposed - proposed0),
                         draft_tokens_accepted=float(len(out) - self.passes))
        return {"seconds": t_end - t_first, "tokens": len(out) - 1, "new_tokens": len(out), "stats": stats, "ids": out}


def main(spec: dict) -> int:
    reply = redirect_stdout()
    import llama_cpp

    runners, unavailable = {}, {"speculative-draft": NO_DRAFT_MODEL}
    for precision, path in spec["gguf"].items():
        for base in BASE_MODES:
            mode = mode_name(base, precision)
            try:
                runners[mode] = Runner(llama_cpp, path, spec, lookup=base == "speculative-lookup")
            except Exception as exc:  # noqa: BLE001 - reported, not fatal
                unavailable[mode] = f"Llama({path}) did not load: {type(exc).__name__}: {exc}"
    hello = {"version": llama_cpp.__version__, "unavailable": unavailable,
             "system_info": llama_cpp.llama_print_system_info().decode(errors="replace")}
    return serve(reply, lambda: hello, lambda req: runners[req["mode"]].decode(
        req["temperature"], req["prompt"], int(req["tokens"]), req["seed"]))


if __name__ == "__main__":
    import json

    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(json.loads(sys.argv[1])))

"""Speculative beam search (the paper's App. A.4) against plain beam search, side by side on one bundle.

    python tools/bench_beam.py BUNDLE [--widths 2,4] [--gammas 1,2,3] [--draft-widths 1,2]
                               [--prompts 4] [--prompt-tokens 64] [--tokens 64] [--rounds 3]
                               [--chat chat|code] [--hf CHECKPOINT] [--out DIR]

For each beam width w, plain beam search (γ = 0, the target alone, beams as rows) and the
speculative one for each γ and draft width u = w x each ``--draft-widths`` factor run the same
prompts, interleaved round by round (round 0 warms up). Every configuration must return the
plain search's sequences (checked, or the tool fails). Reported per configuration: the median
over rounds of the summed wall time of its searches, its speedup over plain at the same w,
beam steps per target round, and the target positions computed per beam step (plain: the
distinct running beams, about w).

A.4's cost model, two ways: a round costs γ draft calls and one target call over up to w + uγ
positions, and advances 1..γ + 1 steps.
- compute-bound (a call costs its positions: small models on this CPU): the gain is at most plain's
  positions per step over the speculative one's; since u >= w it is below 1 at any acceptance.
- memory-bound (a call costs its weights, whatever its rows: large models, GPUs): a verify
  costs a plain step, so the gain is steps-per-round / (1 + c), c a round's draft time over a
  plain step's target time (both measured).
A bundle without --max-batch (rows graphs) runs every beam row as a call of its own, encoder-decoder bundles too.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from specdec.bench.corpus import chat_prompts
from specdec.bench.corpus import prompts as corpus_prompts
from specdec.bench.report import write_results
from specdec.bench.sweep import interleaved
from specdec.runtime import SpeculativeDecoder
from specdec.runtime.params import BeamParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--widths", default="2,4")
    ap.add_argument("--gammas", default="1,2,3")
    ap.add_argument("--draft-widths", default="1,2", help="u as multiples of w")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--chat", choices=["chat", "code"], default=None,
                    help="held-out chat or coding requests (specdec.bench.corpus.HELD_OUT*) through the bundle's chat template, instead of corpus text")
    ap.add_argument("--hf", type=Path, default=None, help="the target's checkpoint: also time transformers' generate(num_beams=w) and check its beams")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    dec = SpeculativeDecoder.load(a.bundle, threads=a.threads)
    corpus = "functions" if dec.manifest.seq2seq else "stdlib"
    prompts = corpus_prompts(corpus, dec.codec.encode, a.prompts, a.prompt_tokens)
    if a.chat:
        prompts, corpus = chat_prompts(a.bundle, dec.manifest, dec.codec, a.chat, a.prompts), f"held-out {a.chat} requests"
    ints = lambda text: [int(x) for x in text.split(",") if x.strip()]  # noqa: E731
    configs = []
    for w in ints(a.widths):
        configs.append((w, 0, w))
        configs += [(w, g, w * f) for g in ints(a.gammas) for f in ints(a.draft_widths)]
    hf = HF(a.hf, dec.manifest) if a.hf else None
    if hf:
        configs += [(w, -1, w) for w in ints(a.widths)]  # γ = -1: transformers
    times: dict[tuple, list[float]] = {c: [] for c in configs}
    stats: dict[tuple, dict] = {}
    ref: dict[tuple, list] = {}
    for rnd, (w, g, u) in interleaved(configs, a.rounds + 1):  # round 0 warms up
        total, steps, rounds, positions, t_sec, d_sec = 0.0, 0, 0, 0, 0.0, 0.0
        for i, p in enumerate(prompts):
            key = (w, i)
            if g < 0:
                t0 = time.perf_counter()
                got = hf.beams(p, w, a.tokens)
                total += time.perf_counter() - t0
                if key in ref and got != ref[key]:
                    raise SystemExit(f"transformers w={w} prompt {i}: {got} != specdec's {ref[key]}")
                continue
            params = BeamParams(num_beams=w, max_new_tokens=a.tokens, gamma=g, draft_width=u)
            t0 = time.perf_counter()
            res = dec.beam_search(p, params)
            total += time.perf_counter() - t0
            got = [b.tokens for b in res.sequences]
            if g == 0:
                ref.setdefault(key, got)
            elif key in ref and got != ref[key]:
                raise SystemExit(f"w={w} gamma={g} u={u} prompt {i}: {got} != plain {ref[key]}")
            s = res.stats
            steps, rounds, positions = steps + s.steps, rounds + s.rounds, positions + s.target_tokens
            t_sec, d_sec = t_sec + s.target_seconds, d_sec + s.draft_seconds
        if rnd:
            times[(w, g, u)].append(total)
        if g < 0:
            continue
        stats[(w, g, u)] = {"steps": steps, "rounds": rounds, "positions": positions, "t_step": t_sec / steps, "d_round": d_sec / rounds}
    rows = []
    for w, g, u in configs:
        med = statistics.median(times[(w, g, u)])
        base = statistics.median(times[(w, 0, w)])
        if g < 0:
            rows.append({"w": w, "gamma": None, "u": None, "runtime": "transformers", "seconds": med, "speedup": base / med})
            continue
        st, plain = stats[(w, g, u)], stats[(w, 0, w)]
        spr, pps = st["steps"] / st["rounds"], st["positions"] / st["steps"]
        c = st["d_round"] / plain["t_step"]  # a round's draft work, in plain steps (target time)
        rows.append({"w": w, "gamma": g, "u": u if g else None, "runtime": "specdec", "seconds": med, "speedup": base / med, "steps_per_round": spr,
                     "positions_per_step": pps, "c": c if g else None,
                     "compute_bound": plain["positions"] / plain["steps"] / pps,  # A.4's count: positions computed per beam step, plain / speculative
                     "memory_bound": spr / (1 + c)})  # a verify costing a plain step  # fmt: skip
    size = f"{a.prompt_tokens} tokens" if not a.chat else "their own length, in the chat template"
    lines = [f"bundle {a.bundle.name}: {len(prompts)} {corpus} prompts of {size}, {a.tokens} new, median of {a.rounds} rounds",
             "", "| w | γ | u | s (all prompts) | speedup vs plain | steps / target round | target positions / step | c (draft per round / plain step) | "
             "A.4 compute-bound | A.4 memory-bound |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if r["runtime"] == "transformers":
            lines.append(f"| {r['w']} | transformers | — | {r['seconds']:.3f} | {r['speedup']:.2f}× | 1 | — | — | — | — |")
            continue
        u, c = ("—", "—") if r["u"] is None else (r["u"], f"{r['c']:.2f}")
        lines.append(f"| {r['w']} | {r['gamma']} | {u} | {r['seconds']:.3f} | {r['speedup']:.2f}× | {r['steps_per_round']:.2f} | {r['positions_per_step']:.1f} | {c} | "
                     f"{r['compute_bound']:.2f}× | {r['memory_bound']:.2f}× |")  # fmt: skip
    text = "\n".join(lines)
    print(text)
    write_results(a.out, text, {"bundle": str(a.bundle), "corpus": corpus, "prompts": len(prompts), "tokens": a.tokens, "rows": rows},
                  plot=lambda path: plot(rows, path.with_name("beam.png"), a.bundle.name))


class HF:
    """transformers' own beam search on the target's checkpoint (PyTorch, this machine's cores)."""

    def __init__(self, path: Path, manifest):
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

        self.torch, self.seq2seq, self.eos = torch, manifest.seq2seq, list(manifest.eos_token_ids)
        cls = AutoModelForSeq2SeqLM if manifest.seq2seq else AutoModelForCausalLM
        self.model = cls.from_pretrained(path).eval()

    def beams(self, prompt: list[int], w: int, new: int) -> list[list[int]]:
        torch = self.torch
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=w, max_new_tokens=new,
                                      eos_token_id=self.eos, pad_token_id=self.eos[0])  # fmt: skip
        seq = out[0, 1 if self.seq2seq else len(prompt) :].tolist()
        end = next((i + 1 for i, t in enumerate(seq) if t in self.eos), len(seq))
        return [seq[:end]]


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = [r for r in rows if r["gamma"]]  # speculative only (not plain, not transformers)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"w{r['w']} γ{r['gamma']} u{r['u']}" for r in spec]
    ax1.barh(labels, [r["speedup"] for r in spec], color="tab:blue")
    ax1.axvline(1.0, color="black", lw=1)
    ax1.set_xlabel("speedup over plain beam search (same w)")
    ax1.invert_yaxis()
    ax2.barh(labels, [r["steps_per_round"] for r in spec], color="tab:green")
    ax2.set_xlabel("beam steps per target call")
    ax2.invert_yaxis()
    ax2.set_yticklabels([])
    fig.suptitle(f"speculative beam search, {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

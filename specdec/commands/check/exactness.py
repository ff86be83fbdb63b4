"""Section 2 of ``specdec check``: is speculative output the target's, on this box?

- greedy: every drafter the bundle carries, one request at a time and in a ``BatchEngine``,
  against the bundle's own autoregressive output (γ = 0) token for token. A first difference is
  allowed only at a close call of the target (its top two logits nearer than ``close_call``),
  where the verify call (K positions) and a 1-token call may round differently; a wrong graph,
  cache or acceptance rule differs at clear calls. A bundle on specdec's row-invariant kernels
  (int8/int4 exported with --kernel blocks) has no close calls: its rows carry the same bits in
  either call, so any difference is wrong.
- sampled: the law of the first emitted token under speculation (T = 1) against the target's p,
  read from the bundle's own target graph, by Pearson's chi-square (``law.py``); the item states
  the test's power. Decoder-only bundles (an encoder-decoder's p needs its encoder: not yet).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from specdec.commands.check import law
from specdec.commands.check.items import Item

SECTION = "exactness"
LEVEL = 1e-3  # a sampled check fails below this p-value: a false alarm 1 run in 1000 per drafter; a broken
# sampler (tests/check: a residual that forgets the draft) gives p < 1e-10 at the runs used
MIN_PATHS = 0.05  # the first draft must be both accepted and rejected at least this share of runs, or the test
# cannot see the residual path (or the acceptance path): reported, not failed
PAIRING = 0.02  # a draft model whose argmax is the target's next greedy token at fewer than 2% of the positions
PAIRING_POSITIONS = 40  # (over >= 40, teacher-forced along the target's greedy path) is not this target's: a
# token agrees by chance ~1/V of the time, while a weak draft of the same tokenizer agrees at >= 20% of
# positions (the shipped SmolLM2 draft: 34% held out), which leaves 40 positions at 0 agreements with odds < 1.4e-4
CLOSE_FLOAT = 1e-3  # float bundles: a close call is a top-2 gap < this x max(1, max|logit|) (export's NEAR_TIE),
# or < 4x the verify-vs-reference max|Δ logits| export measured, whichever is larger
CLOSE_QUANTIZED = 0.05  # int8/int4 on MatMulNBits (--kernel nbits): activations are quantized per block of each call,
# so a K-token verify call and a 1-token call differ by ~1% of the logits' scale (docs/exactness.md): 5% of max|logit|


def carried(m) -> list[str]:
    """The drafters this bundle has what they need for, the default first."""
    from specdec.runtime.drafters import DRAFTERS, bundle_default

    models = {g.model for g in m.graphs.values()}
    tree = any(g.model == "target" and g.role == "tree" for g in m.graphs.values())
    names = [n for n, r in DRAFTERS.items()
             if (not r.needs_draft_model or "draft" in models) and (not r.needs_head or "head" in models)
             and (not r.tree or tree) and (n not in ("ngram", "unigram") or m.ngram)]  # fmt: skip
    first = bundle_default(m)
    return [first, *(n for n in names if n != first)]


def row_invariant(m) -> bool:
    """Whether every verify call of this bundle gives each row a 1-row call's bits: int8/int4 on
    specdec's kernels (the manifest's custom_ops), without a tree graph (whose attention, with its
    tree mask, stays ONNX Runtime's)."""
    from specdec.engines import blocks_op

    return bool(m.custom_ops) and blocks_op.library() is not None and not any(g.role == "tree" for g in m.graphs.values())


def kernels(m) -> Item | None:
    """What runs a quantized bundle's products and attention here, and what exactness that gives."""
    from specdec.engines import blocks_op

    if m.custom_ops and blocks_op.library() is None:
        return Item(SECTION, "kernels", None, "specdec's kernel library is not built in this install, so the bundle runs on ONNX Runtime's "
                                              "MatMulNBits and GroupQueryAttention (engines/fallback.py): a verify call's rows can differ "
                                              "from a 1-row call at an int8 rounding, so greedy output may part at a close call (re-install "
                                              "specdec where gcc or clang is present)")  # fmt: skip
    if m.custom_ops:
        isa = blocks_op.isa()
        ops = ", ".join(m.custom_ops["ops"])
        return Item(SECTION, "kernels", True, f"specdec's {ops} ({m.custom_ops['domain']}) on {isa}: a verify call's rows carry a 1-row "
                                              "call's bits, so greedy speculative output must equal autoregressive token for token")  # fmt: skip
    if m.quantization in ("int8", "int4"):
        return Item(SECTION, "kernels", None, "ONNX Runtime's MatMulNBits and GroupQueryAttention: a verify call's rows can differ from a "
                                              "1-row call at an int8 rounding, so greedy output may part at a close call (re-export with "
                                              "--kernel blocks for token-for-token equality)")  # fmt: skip
    return None


def close_call_gap(m, logits: np.ndarray) -> float:
    """The top-2 gap below which a greedy step of this bundle is a close call (see the constants)."""
    scale = max(1.0, float(np.abs(logits).max()))
    if row_invariant(m):
        return 0.0
    if m.quantization:
        return CLOSE_QUANTIZED * scale
    measured = (m.validation.get("target") or {}).get("logits") or 0.0
    return max(CLOSE_FLOAT * scale, 4 * measured)


def first_difference(got: Sequence[int], want: Sequence[int]) -> int | None:
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
    return i if i is not None or len(got) == len(want) else min(len(got), len(want))


class Judge:
    """Whether a divergence of a greedy continuation is a close call of the target."""

    def __init__(self, m, runner):
        self.m, self.runner = m, runner  # runner: the target's dynamic graph (None: no judging, an encoder-decoder)

    def differs(self, prompt: list[int], got: list[int], want: list[int]) -> tuple[str, str | None]:
        """("same" | "close" | "wrong", a description of the first difference)."""
        i = first_difference(got, want)
        if i is None:
            return "same", None
        where = f"token {i} (got {got[i] if i < len(got) else 'end'}, autoregressive {want[i] if i < len(want) else 'end'})"
        if self.runner is None or i >= min(len(got), len(want)):
            return "wrong", where
        logits = self.runner.logits(list(prompt) + list(want[:i]))[-1].astype(np.float64)
        top2 = np.sort(logits)[-2:]
        gap, bound = float(top2[1] - top2[0]), close_call_gap(self.m, logits)
        return ("close" if gap < bound else "wrong"), f"{where}, target's top-2 gap {gap:.3g} (close below {bound:.3g})"


def _verdict(label: str, outcomes: list[tuple[str, str | None]], prompts: int, tokens: int) -> Item:
    wrong = [d for kind, d in outcomes if kind == "wrong"]
    close = [d for kind, d in outcomes if kind == "close"]
    if wrong:
        return Item(SECTION, label, False, f"{len(wrong)} of {prompts} requests differ from autoregressive; first at {wrong[0]}",
                    "this drafter or graph is not exact here: report it with this output (specdec check --json)")  # fmt: skip
    tail = f"; {len(close)} ended at a close call of the target ({close[0]})" if close else ""
    return Item(SECTION, label, True, f"{prompts - len(close)} of {prompts} requests x {tokens} tokens identical to autoregressive{tail}")


def greedy(bundle: Path, m, loaded, prompts: list[list[int]], tokens: int, threads, batch_drafters: list[str], provider: str = "cpu") -> list[Item]:
    """Greedy speculative output of each drafter (batch 1, and ``batch_drafters`` in a BatchEngine) against γ = 0."""
    from specdec.runtime.batch import BatchEngine

    kw = dict(max_new_tokens=tokens, ignore_eos=True)
    want = [loaded.base.generate(p, gamma=0, **kw).tokens for p in prompts]
    judge = Judge(m, loaded.runner)
    items = []
    for name, dec in loaded.decoders.items():
        got = [dec.generate(p, gamma=m.gamma, **kw).tokens for p in prompts]
        items.append(_verdict(f"greedy, {name}", [judge.differs(p, g, w) for p, g, w in zip(prompts, got, want)], len(prompts), tokens))
    for name in batch_drafters:
        engine = BatchEngine(bundle, drafter=name, threads=threads, manifest=m, provider=provider)
        try:
            got = [r.tokens for r in engine.generate_many(prompts, gamma=m.gamma, **kw)]
        finally:
            engine.close()
        label = f"greedy, {name}, BatchEngine ({engine.max_batch} row{'s' if engine.max_batch > 1 else ''})"
        items.append(_verdict(label, [judge.differs(p, g, w) for p, g, w in zip(prompts, got, want)], len(prompts), tokens))
    has_graph = any(g.model == "draft" and g.role == "dynamic" for g in m.graphs.values())  # older bundles may lack it
    pairing = draft_pairing(bundle, m, prompts, want, threads) if "model" in loaded.decoders and has_graph and not m.seq2seq else None
    return items + ([pairing] if pairing else [])


def against_cpu(bundle: Path, m, loaded, prompts: list[list[int]], tokens: int, threads, provider: str) -> Item:
    """Autoregressive greedy output on ``provider`` against the same bundle's on the CPU: another
    device sums in another order, so a difference is judged at the target's close calls (on the CPU)."""
    from specdec.commands.bench.quality import TargetRunner
    from specdec.runtime.decoder import SpeculativeDecoder

    cpu = SpeculativeDecoder.load(bundle, threads=threads, drafter="lookup", verify="size")
    kw = dict(max_new_tokens=tokens, ignore_eos=True, gamma=0)
    judge = Judge(m, None if m.seq2seq else TargetRunner(bundle, threads))
    outcomes = [judge.differs(p, loaded.base.generate(p, **kw).tokens, cpu.generate(p, **kw).tokens) for p in prompts]
    return _verdict(f"greedy on {provider} against the CPU (autoregressive)", outcomes, len(prompts), tokens)


def draft_pairing(bundle: Path, m, prompts: list[list[int]], greedy: list[list[int]], threads) -> Item | None:
    """An integrity item on whether the draft model is this target's (the same tokens): its argmax
    along the target's greedy continuations, teacher-forced (one draft call per request)."""
    from specdec.commands.bench.quality import TargetRunner

    draft = TargetRunner(bundle, threads, model="draft")
    agree = positions = 0
    for prompt, cont in zip(prompts, greedy):
        if not cont:
            continue
        logits = draft.logits(list(prompt) + list(cont[:-1]))[len(prompt) - 1 :]  # [len(cont), V]: the draft's guess for each
        agree += int((logits.argmax(-1) == np.asarray(cont)).sum())
        positions += len(cont)
    if positions < PAIRING_POSITIONS:
        return None
    share = agree / positions
    if share < PAIRING:
        return Item("integrity", "draft pairing", False, f"the draft model's argmax is the target's greedy token at {agree} of {positions} positions: "
                                                         "chance level, as a draft with another tokenizer or vocabulary order would be",
                    "export with a draft made for this target's tokenizer (or serve with --drafter lookup)")  # fmt: skip
    return Item("integrity", "draft pairing", True, f"the draft model's argmax is the target's greedy token at {share:.0%} of {positions} positions")


def first_token_runs(dec, m, prompt: list[int], seeds: range) -> tuple[np.ndarray, int, int]:
    """Counts [V] of the first emitted token over seeded T = 1 runs, and the first draft's (accepted, drafted)."""
    counts = np.zeros(m.vocab_size, dtype=np.int64)
    accepted = drafted = 0
    for seed in seeds:
        req = dec.request(prompt, max_new_tokens=2, gamma=m.gamma, temperature=1.0, seed=seed, ignore_eos=True)
        stream = dec.run(req, incremental_text=False, reuse=True)  # the prompt's rows stay cached between runs
        for _ in stream:
            pass
        res = stream.result
        counts[res.tokens[0]] += 1
        accepted += res.stats.accepted_at[0] if res.stats.accepted_at else 0
        drafted += res.stats.drafted_at[0] if res.stats.drafted_at else 0
    return counts, accepted, drafted


PILOT = 40  # seeded runs per prompt to find one whose first draft is both accepted and rejected


def pick_prompt(dec, m, runner, prompts: list[list[int]]) -> tuple[list[int], np.ndarray]:
    """The prompt that exercises both paths best (first-draft acceptance nearest 1/2 in a short
    pilot; then the most entropy: the most bins to test), and the target's law after it (T = 1)."""
    from specdec.runtime.sampling import softmax

    scored = []
    for k, prompt in enumerate(prompts):
        p = softmax(runner.logits(prompt)[-1].astype(np.float64))
        _, accepted, drafted = first_token_runs(dec, m, prompt, range(10**6, 10**6 + PILOT))  # seeds apart from the test's
        share = accepted / drafted if drafted else 0.0
        entropy = float(-(p * np.log(np.maximum(p, 1e-300))).sum())
        scored.append((round(min(share, 1 - share), 1), entropy, k, p))
    _, _, k, p = max(scored, key=lambda s: s[:3])
    return prompts[k], p


def sampled(m, loaded, prompts: list[list[int]], runs: int, drafters: list[str]) -> list[Item]:
    """The first emitted token's law under speculation, per drafter, against the target's."""
    if m.seq2seq:
        return [Item(SECTION, "sampled", None, "not checked for encoder-decoder bundles yet (greedy above is)")]
    items = []
    for name in drafters:
        dec = loaded.decoders[name]
        prompt, p = pick_prompt(dec, m, loaded.runner, prompts)
        counts, accepted, drafted = first_token_runs(dec, m, prompt, range(runs))
        stat, df, pvalue = law.pearson(counts, p)
        w = law.detectable_effect(runs, df, LEVEL)
        power = f"{runs} runs, {df + 1} bins: a law at Cohen's w >= {w:.2f} from the target's is caught 4 times in 5"
        share = accepted / drafted if drafted else 0.0
        label = f"sampled, {name}"
        if df < 1:
            items.append(Item(SECTION, label, None, f"the target's first token is nearly certain after the chosen prompt: nothing to test ({power})"))
        elif pvalue < LEVEL:
            items.append(Item(SECTION, label, False, f"first token's law differs from the target's: chi-square {stat:.1f} on {df} df, p = {pvalue:.2g} ({power})",
                              "speculative sampling is not exact here: report it with this output (specdec check --json)"))  # fmt: skip
        elif drafted < MIN_PATHS * runs:
            what = "proposed no first token on these prompts: only" if not drafted else f"proposed a first token in only {drafted} of {runs} runs: mostly"
            items.append(Item(SECTION, label, None, f"p = {pvalue:.2g}, but the drafter {what} plain sampling was tested ({power})"))
        elif not MIN_PATHS <= share <= 1 - MIN_PATHS:
            items.append(Item(SECTION, label, None, f"p = {pvalue:.2g}, but the first draft was accepted in {share:.0%} of runs: "
                                                    f"one of its two paths is barely exercised ({power})"))  # fmt: skip
        else:
            items.append(Item(SECTION, label, True, f"first token's law is the target's: p = {pvalue:.2g} (fails below {LEVEL:g}); "
                                                    f"first draft accepted in {share:.0%} of runs; {power}"))  # fmt: skip
    return items

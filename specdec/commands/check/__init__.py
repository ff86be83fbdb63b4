"""``specdec check BUNDLE``: is this bundle exact on this box, and does speculation pay here?

Three sections, each a list of ``Item``s (docs/check.md reads a real report):

1. integrity (``integrity.py``): digests, the graphs' I/O against the manifest, versions;
2. exactness (``exactness.py``, and ``reference.py`` with ``--reference``): greedy speculative
   output of every drafter the bundle carries against its own autoregressive output, alone and
   in a ``BatchEngine``; the sampled law of the first token against the target's p;
3. speed (``speed.py``): α, c and v(k) measured, Theorem 3.8's prediction per γ set beside the
   measurement, and the settings to serve with.

Runs on the runtime's dependencies; ``--reference`` needs PyTorch. A failed integrity check
stops there (the other sections would test other bytes than the manifest's).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec.commands.check.items import Item, Loaded

PLAIN_TEXTS = (  # built-in prompts of a bundle with a tokenizer and no chat template
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three largest cities of France are",
    "import json\n\n\ndef load_config(path):\n",
    "Speculative decoding speeds up a language model by",
)


@dataclass(frozen=True)
class Settings:
    """How much a check measures: ``quick`` (under a minute for a 135M bundle) or full."""

    prompts: int
    tokens: int  # greedy tokens per request
    runs: int  # seeded runs of the sampled check
    speed_tokens: int
    rounds: int
    every_drafter_sampled: bool
    every_drafter_batched: bool

    @classmethod
    def of(cls, quick: bool) -> Settings:
        if quick:
            return cls(prompts=2, tokens=24, runs=300, speed_tokens=48, rounds=1, every_drafter_sampled=False, every_drafter_batched=False)
        return cls(prompts=4, tokens=64, runs=1000, speed_tokens=128, rounds=2, every_drafter_sampled=True, every_drafter_batched=True)


def prompts(bundle: Path, m, count: int, texts: list[str] | None = None) -> list[list[int]]:
    """Token ids of the prompts: ``texts`` (one user turn each through the chat template when the
    bundle has one), else built-in held-out requests or texts; seeded random ids without a tokenizer."""
    from specdec.errors import InputError
    from specdec.runtime.text import TextCodec

    codec = TextCodec.from_bundle(bundle, m)
    if codec is None:
        if texts:
            raise InputError(f"--prompts: bundle {bundle} has no tokenizer to encode text with; leave --prompts out (random token ids are used)")
        rng = np.random.default_rng(0)
        return [rng.integers(3, m.vocab_size, 12).tolist() for _ in range(count)]
    template = _template(bundle, m, codec)
    if texts is None:
        if template is not None:
            from specdec.commands.bench.corpus import chat_texts

            texts = [t for pair in zip(chat_texts("chat", count), chat_texts("code", count)) for t in pair][:count]
        else:
            texts = list(PLAIN_TEXTS[:count])
    rendered = [template.render([{"role": "user", "content": t}]) if template else t for t in texts]
    out = [codec.encode(t) for t in rendered]
    limit = m.max_seq_len // 2
    return [ids[-limit:] for ids in out if ids]


def _template(bundle: Path, m, codec):
    try:
        from specdec.serve.chat import bundle_template
    except ImportError:  # jinja2 (the serve extra) is not installed: prompts go in as plain text
        return None
    return bundle_template(bundle, m, codec)


def run(bundle: Path, *, quick: bool = False, texts: list[str] | None = None, reference: str | None = None, threads=None,
        progress=lambda step: None, provider: str = "cpu") -> list[Item]:  # fmt: skip
    """Every section's items, in order; ``progress(step)`` is told as each step starts. ``provider``:
    where decoding is checked (cuda, cuda-graph: also its autoregressive tokens against the CPU's)."""
    from specdec.commands.check import exactness, integrity, speed

    s = Settings.of(quick)
    progress("integrity")
    items, m = integrity.check(bundle)
    if m is None:
        return items
    items += [k for k in [exactness.kernels(m)] if k is not None]
    ps = prompts(bundle, m, s.prompts if texts is None else len(texts), texts)
    drafters = exactness.carried(m)
    loaded = Loaded.of(bundle, m, drafters, threads, provider)
    progress("greedy exactness")
    items += exactness.greedy(bundle, m, loaded, ps, s.tokens, threads, drafters if s.every_drafter_batched else drafters[:1], provider)
    if provider != "cpu":
        items.append(exactness.against_cpu(bundle, m, loaded, ps, s.tokens, threads, provider))
    if reference:
        progress("reference")
        from specdec.commands.check import reference as ref

        items += ref.check(m, loaded, reference, ps, s.tokens)
    progress("sampled exactness")
    items += exactness.sampled(m, loaded, ps, s.runs, drafters if s.every_drafter_sampled else drafters[:1])
    progress("speed")
    items += speed.check(bundle, m, loaded, ps, s.speed_tokens, s.rounds, threads, quick or provider != "cpu")  # threads: the CPU's advice
    return items


def passed(items: list[Item]) -> bool:
    return not any(i.ok is False for i in items)


MARKS = {True: "✓", False: "✗", None: "·"}


def report(bundle: Path, items: list[Item], seconds: float) -> str:
    """The readable report: a table per section, the fix under each failure."""
    lines = [f"specdec check {bundle}: {'PASSED' if passed(items) else 'FAILED'} in {seconds:.0f} s"]
    for section in dict.fromkeys(i.section for i in items):
        lines += ["", f"## {section}", "", "| | check | result |", "|---|---|---|"]
        rows = [i for i in items if i.section == section]
        lines += [f"| {MARKS[i.ok]} | {i.name} | {i.detail} |" for i in rows]
        lines += [f"\n✗ {i.name}: {i.fix}" for i in rows if i.ok is False and i.fix]
    lines += ["", "✓ passed · ✗ failed (the exit status is then 1) · · measured, for reading"]
    return "\n".join(lines)


def as_json(bundle: Path, items: list[Item], seconds: float) -> dict:
    return {"bundle": str(bundle), "passed": passed(items), "seconds": round(seconds, 1), "items": [i.as_dict() for i in items]}


def timed(fn, *args, **kw) -> tuple[list[Item], float]:
    t0 = time.perf_counter()
    items = fn(*args, **kw)
    return items, time.perf_counter() - t0

"""What no training sees: the CPython stdlib split of the demo pair (the split rule lives only
here) and the benchmark's held-out chat and coding requests.

The foundation (imported by export's head training, the benchmark, ``specdec check`` and the
self-distillation recipe alike), so the held-out side is one definition for all of them.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

EXCLUDED = {"site-packages", "test", "tests", "idle_test", "testing", "_vendor", "vendor"}

# Everyday chat, written here; no template of tools/train/smollm2_draft.py makes prompts of this kind.
HELD_OUT = (
    "Why is the sky blue?",
    "Give me three tips for sleeping better.",
    "What should I pack for a weekend hiking trip?",
    "Explain the difference between weather and climate.",
    "Write a short poem about autumn leaves.",
    "How do vaccines train the immune system?",
    "What are the main causes of inflation?",
    "Suggest a simple recipe for dinner with rice and vegetables.",
    "How can I improve my public speaking?",
    "What is the water cycle?",
    "Describe a good morning routine for a student.",
    "Why do cats purr?",
)

# Coding requests, written here: the SmolLM2 draft's domain (its training prompts asked for code
# and explanations of installed Python), but none of these prompts or their functions is among them.
HELD_OUT_CODE = (
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that reverses the words in a sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function that counts the vowels in a string.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Explain what a Python list comprehension is, with an example.",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "Write a Python function that removes duplicates from a list while keeping the order.",
)


def stdlib_files(held_out: bool) -> list[Path]:
    """CPython stdlib ``.py`` files (no site-packages, no test packages), split by file: a file
    is held out when the sha256 of its relative path is 0 mod 20 (the demo pair's split)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for f in sorted(stdlib.rglob("*.py")):
        rel = f.relative_to(stdlib)
        if EXCLUDED & set(rel.parts):
            continue
        if (int(hashlib.sha256(str(rel).encode()).hexdigest(), 16) % 20 == 0) == held_out:
            out.append(f)
    return out


def held_out_prompts(encode, count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens: the opening of held-out stdlib files long enough
    (``specdec bench --corpus stdlib``'s, and export's measurement of the default drafter)."""
    prompts = []
    for f in stdlib_files(held_out=True):
        ids = encode(f.read_text(encoding="utf-8", errors="replace"))
        if len(ids) >= length * 2:
            prompts.append(ids[:length])
        if len(prompts) == count:
            break
    return prompts

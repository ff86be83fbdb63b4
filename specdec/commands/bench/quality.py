"""How much a quantized (or otherwise changed) target is still the same model, as users feel it.

Three figures against a reference model (the float32 bundle), on held-out text and prompts:

- **perplexity** of the held-out text (teacher-forced: every window starts from an empty cache);
- **mean KL(p_ref || p)** of the next-token distribution over the same positions;
- **greedy tokens kept**: per prompt, how many tokens of the reference's greedy continuation
  come out before the first difference (a model that leaves the answer at token 2 keeps 1).

The math is pure NumPy on log-probabilities, so other engines (llama.cpp's logits, run in its
own venv) are judged by the same functions. ``window_logprobs`` and ``greedy_tokens`` run a
specdec bundle's target graph directly with the runtime's engine.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from specdec.divergence import kl, nll  # re-exported
from specdec.runtime.sampling import log_softmax  # float64, positions x vocabulary (re-exported)


def kept(reference: Sequence[int], tokens: Sequence[int]) -> int:
    """Length of the common prefix: greedy tokens kept before the first difference."""
    n = 0
    for a, b in zip(reference, tokens):
        if a != b:
            break
        n += 1
    return n


def prose_windows(encode: Callable[[str], list[int]], count: int, length: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens of English prose: the docstrings of the held-out
    stdlib files (``specdec.commands.bench.corpus``), concatenated in file order. Fixed for a Python version."""
    from specdec.commands.bench.corpus import stdlib_files

    ids: list[int] = []
    for f in stdlib_files(held_out=True):
        try:
            tree = ast.parse(f.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    ids += encode(doc + "\n\n")
        if len(ids) >= count * length:
            break
    return [ids[i * length : (i + 1) * length] for i in range(min(count, len(ids) // length))]


def code_windows(encode: Callable[[str], list[int]], count: int, length: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens of Python source: held-out stdlib files, one window each."""
    from specdec.commands.bench.corpus import stdlib_files

    out = []
    for f in stdlib_files(held_out=True):
        ids = encode(f.read_text(encoding="utf-8", errors="replace"))
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == count:
            break
    return out


class TargetRunner:
    """A bundle's target dynamic graph over its own cache: logits of a window from an empty cache.
    ``model="draft"``: the draft model's dynamic graph instead; ``provider``: where it runs (its KV there)."""

    def __init__(self, bundle: Path, threads: int | None = None, model: str = "target", provider: str = "cpu"):
        from specdec.engines.kv import KVCache
        from specdec.engines.ort import runner_for
        from specdec.engines.sessions import DEVICE
        from specdec.manifest import load_manifest

        m = load_manifest(bundle, verify="size", stamps=False)
        t = getattr(m, model)
        self.cache = KVCache(t.num_layers, t.num_kv_heads, m.max_seq_len, t.head_dim, m.dtype, DEVICE[provider])
        name, spec = m.graph(model, "dynamic")
        self.runner = runner_for(Path(bundle), name, spec, self.cache, provider=provider, threads=threads)

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """[n, V] float32, a copy."""
        self.cache.rewind_to(0)
        return np.array(self.runner.run(np.asarray(tokens, dtype=np.int64)))


def window_logprobs(logits: Sequence[np.ndarray]) -> np.ndarray:
    """Log-probabilities of every position of every window's logits [n_w, V], stacked. [sum(n_w), V]"""
    return np.concatenate([log_softmax(x) for x in logits])


def scores(ref_logp: np.ndarray, logp: np.ndarray, windows: Sequence[Sequence[int]]) -> dict[str, float]:
    """Perplexity of the windows under ``logp`` and mean KL(ref || logp) over their positions."""
    losses, start = [], 0
    for w in windows:
        losses.append(nll(logp[start : start + len(w)], w))
        start += len(w)
    return {"perplexity": float(np.exp(np.concatenate(losses).mean())), "mean_kl": float(kl(ref_logp, logp).mean())}

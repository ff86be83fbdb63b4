"""What exported graphs must meet against PyTorch (``Tolerance``, per precision), the figures
that measure it (``Agreement``) and the check that refuses a bundle (``check``); the runs that
gather the figures are export/validate.py's and export/validate_rows.py's."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from specdec.errors import ValidationError
from specdec.export.draft_spec import FILL


@dataclass(frozen=True)
class Tolerance:
    """What a model's exported graphs must meet against PyTorch.

    rel: largest |Δ| of logits, and of KV rows, as a fraction of the reference's own scale,
        max(1, max|reference|) over the checked calls (inf: not bounded, figures recorded only);
    min_top1: smallest share of checked positions whose top-1 token agrees, near-ties excepted.
    min_text_top1, max_text_kl: the same share, and the largest mean KL(PyTorch || graph) in
        nats, over ``VALIDATION_TEXT`` teacher-forced: real text, where a model that quantizes
        badly shows (random tokens give flat distributions that hide it).
    """

    rel: float
    min_top1: float
    min_text_top1: float = 0.0
    max_text_kl: float = float("inf")

    def bound(self, scale: float) -> float:
        return self.rel * max(1.0, scale)


# float32 is bounded relative to the logits' scale, not absolutely: float32 reordering (ORT's
# fused kernels and packed MatMuls sum in another order than PyTorch) leaves a relative error of
# ~1e-6 per op that grows with depth and with the magnitude of what is summed, so a fixed 1e-4
# passes a 3-layer test model (logits ~10) and refuses a correct 30-layer real model (logits
# ~30: SmolLM2-135M measures 2e-4). 1e-4 of the scale is still ~50x below what a wrong graph
# gives (a wrong RoPE base, swapped KV heads or a missing layer: 1e-1 and more), and the top-1
# check below holds every position exactly. float16 and quantized weights change the model
# itself, so only gross breakage is refused and the measured figures are recorded. The floors
# sit well below what the demo pair measures on random tokens (top-1 0.98 weight-only int8,
# 0.91 int4, block 32) so that a model that quantizes worse still exports, while a broken graph
# (agreement near 1/V) is refused.
#
# On real text the quantized bounds are set between what a kept and a lost model measure on
# SmolLM2-135M-Instruct (docs/quantization.md): int8 (q8_0) gives top-1 0.96 and mean KL 0.006
# nats, int4 (q4_1) 0.98 and 0.003, while an int4 that lost the model (symmetric blocks or a
# rounded zero point on the Q4_1 file's weights) gives top-1 0.66-0.74 and KL 0.26-0.39.
# KL <= 0.05 is ~10x what the kept models measure and ~5x under the lost ones; text top-1 is
# recorded. ``specdec-export --max-kl`` sets another bound (a small model with random weights,
# as the tests build, loses more at int4: KL ~0.2).
# With ``--max-kl`` the user bounds how far a changed target may drift, and the top-1 share on
# random tokens then refuses only a broken graph. A model whose logits barely separate (random
# weights at size, tools/make_sized_pair.py: top-2 gaps ~0.3) flips most argmaxes under int4
# (0.19 measured on Qwen2.5-0.5B's body) while its KL on real text stays small (0.056 nats); a
# broken graph agrees near 1/V.
BROKEN_TOP1 = 0.05

TOLERANCES = {
    ("float32", None): Tolerance(1e-4, 1.0, min_text_top1=1.0),
    ("float16", None): Tolerance(float("inf"), 0.9, max_text_kl=0.05),
    ("float32", "int8"): Tolerance(float("inf"), 0.8, max_text_kl=0.05),
    ("float32", "int4"): Tolerance(float("inf"), 0.5, max_text_kl=0.05),
    ("float32", "dynamic-int8"): Tolerance(float("inf"), 0.5),
}


def tolerance(dtype: str, quantization: str | None, model: str, max_kl: float | None = None) -> Tolerance:
    """What a graph of ``model`` ("target"/"draft") at that precision must meet. A lossy draft
    costs acceptance, never exactness: its text figures are recorded only. ``max_kl`` (the
    user's bound, ``--max-kl``) replaces a changed target's KL bound and leaves top-1 on random
    tokens to refuse only a broken graph (``BROKEN_TOP1``)."""
    tol = TOLERANCES[(dtype, quantization)]
    if model == "draft":
        return dataclasses.replace(tol, max_text_kl=float("inf"))
    if max_kl is not None and tol.rel == float("inf"):
        return dataclasses.replace(tol, max_text_kl=max_kl, min_top1=min(tol.min_top1, BROKEN_TOP1))
    return tol


# Real text for the check above, written here: English prose and Python, as a chat model meets
# them. Teacher-forced from an empty cache; the first VALIDATION_TOKENS of its tokens are used.
VALIDATION_TEXT = """\
The library opens at nine in the morning and closes at six in the evening. Visitors may borrow up \
to five books at a time, and each loan lasts three weeks. If you need a book for longer, ask at the \
front desk and the staff will renew it, unless another reader has reserved it.

def average(values):
    \"\"\"Return the arithmetic mean of a non-empty list of numbers.\"\"\"
    if not values:
        raise ValueError("average() of an empty list")
    return sum(values) / len(values)
"""
VALIDATION_TOKENS = 128

# A position whose reference top-2 gap is below NEAR_TIE x max(1, max|its logits|) is a near-tie:
# its top-1 may flip under any rounding (float32's bound allows 2 x 1e-4 of the scale), so it
# does not count toward top-1 agreement. It is counted apart (``near_ties``).
NEAR_TIE = 1e-3


def magnitude(ref: np.ndarray) -> np.ndarray:
    """max |logit| per row of [S, V] reference logits, over real logits only: a shared draft's
    logits outside its vocabulary subset are FILL (-1e4) in both graphs and PyTorch, equal, and
    would otherwise make the scale, and so the bound, 300x looser (export/shared_draft.py)."""
    return np.abs(np.where(ref > FILL / 2, ref, 0.0)).max(-1)


class Agreement:
    """Running figures of one graph against PyTorch: max |Δ| and scale of the logits, and top-1
    agreement over positions that are not near-ties (with the largest top-2 gap it missed)."""

    def __init__(self) -> None:
        self.max_abs, self.scale = 0.0, 0.0
        self.agree = self.counted = self.positions = self.ties = 0
        self.missed_gap = 0.0  # the reference's top-2 gap at the worst disagreement

    def logits(self, ours: np.ndarray, ref: np.ndarray) -> None:
        """``ours``, ``ref``: [S, V] logits of the same S positions."""
        self.max_abs = max(self.max_abs, float(np.abs(ours - ref).max()))
        self.scale = max(self.scale, float(magnitude(ref).max()))
        self.tokens(ours.argmax(-1), ref)

    def tokens(self, ours: np.ndarray, ref: np.ndarray) -> None:
        """``ours``: [S] token ids the graph chose; ``ref``: [S, V] PyTorch's logits there."""
        top2 = np.partition(ref, -2, axis=-1)[:, -2:]
        gap = top2[:, 1] - top2[:, 0]
        tie = gap < NEAR_TIE * np.maximum(1.0, magnitude(ref))
        wrong = (np.asarray(ours) != ref.argmax(-1)) & ~tie
        self.positions += len(gap)
        self.ties += int(tie.sum())
        self.counted += int((~tie).sum())
        self.agree += int((~tie).sum() - wrong.sum())
        if wrong.any():
            self.missed_gap = max(self.missed_gap, float(gap[wrong].max()))

    def matches(self, same: np.ndarray) -> None:
        """Positions checked by equality alone (a sampled draw against its inverse CDF)."""
        self.positions += len(same)
        self.counted += len(same)
        self.agree += int(np.sum(same))

    def figures(self) -> dict:
        return {"logits": self.max_abs, "logits_scale": self.scale, "top1_agreement": self.agree / max(1, self.counted),
                "positions": self.positions, "near_ties": self.ties, "top1_missed_gap": self.missed_gap}  # fmt: skip


GREEDY_PROMPTS, GREEDY_STEPS = 3, 16


def text_tokens(tokenizer, max_seq: int) -> tuple[int, ...]:
    """``VALIDATION_TEXT`` in ``tokenizer``'s ids, at most VALIDATION_TOKENS and max_seq / 2; () without a tokenizer."""
    if tokenizer is None:
        return ()
    ids = tokenizer(VALIDATION_TEXT, add_special_tokens=False)["input_ids"]
    return tuple(int(i) for i in ids[: min(VALIDATION_TOKENS, max_seq // 2)])


def check(figures: dict[str, dict[str, float]], tolerances: dict[str, Tolerance]) -> None:
    """Raise one ValidationError naming every failed check: which graph and output, the figure,
    and the bound it broke (``tolerances``: figure name -> Tolerance)."""
    bad = []
    for model, f in figures.items():
        tol = tolerances[model]
        scales = {"logits": f.get("logits_scale"), "present_key": f.get("kv_scale"), "present_value": f.get("kv_scale")}
        for out, scale in scales.items():  # a fused graph's "logits": its q rows
            if f.get(out) is not None and f[out] > tol.bound(scale or 0.0):
                what = "max|logit|" if out == "logits" else "max|kv|"
                bad.append(f"{model} {out}: max|Δ| {f[out]:.3g} > {tol.bound(scale or 0.0):.3g} ({tol.rel:g} x max(1, {what} {scale or 0.0:.3g}))")
        if tol.min_top1 >= 1.0 and f.get("greedy_mismatches"):
            bad.append(f"{model} greedy: {f['greedy_mismatches']} of {GREEDY_PROMPTS} rollouts chose another token than PyTorch's argmax loop "
                       f"({f['greedy_steps']} steps compared, near-ties excepted)")
        if f["top1_agreement"] < tol.min_top1:
            counted = f["positions"] - f.get("near_ties", 0)
            missed = round((1 - f["top1_agreement"]) * counted)
            bad.append(
                f"{model} top-1: agreement {f['top1_agreement']:.3f} < {tol.min_top1:g} ({missed} of {counted} positions differ, "
                f"reference top-2 gap up to {f.get('top1_missed_gap', 0.0):.3g}; {f.get('near_ties', 0)} near-ties "
                f"(gap < {NEAR_TIE:g} x max(1, max|logit|)) not counted)"
            )
        if "text_top1" in f and f["text_top1"] < tol.min_text_top1:
            bad.append(f"{model} on real text: top-1 agreement {f['text_top1']:.3f} < {tol.min_text_top1:g} over {f['text_positions']} "
                       "tokens of VALIDATION_TEXT (near-ties not counted)")
        if "text_kl" in f and f["text_kl"] > tol.max_text_kl:
            bad.append(f"{model} on real text: mean KL {f['text_kl']:.4f} nats > {tol.max_text_kl:g} over {f['text_positions']} "
                       "tokens of VALIDATION_TEXT: not the same model (export it wider, e.g. --quantize int8, or accept it with --max-kl)")
    if bad:
        raise ValidationError("exported graphs disagree with PyTorch: " + "; ".join(bad) + "; no bundle was written")

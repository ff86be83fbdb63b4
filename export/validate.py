"""Export-time validation: the exported graphs, run by the runtime's own engine, against PyTorch.

For one model: a random prompt through the dynamic-length graph, then several calls of the static graph
(S = K for the target's verify graph, 1 for the draft's step graph) with random tokens, each
followed by a partial acceptance (keep 1..S rows) and sometimes a deeper rewind, exactly as
the decoding loop rolls back. PyTorch runs the same tokens with a DynamicCache cropped to the
same length. Every call's logits and, at the end, the committed KV rows are compared.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specdec.engines.kv import KVCache
from specdec.engines.ort import runner_for
from specdec.engines.sessions import open_session
from specdec.errors import ValidationError
from specdec.export.draft_spec import FILL
from specdec.manifest import GraphSpec


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


def _magnitude(ref: np.ndarray) -> np.ndarray:
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
        self.scale = max(self.scale, float(_magnitude(ref).max()))
        self.tokens(ours.argmax(-1), ref)

    def tokens(self, ours: np.ndarray, ref: np.ndarray) -> None:
        """``ours``: [S] token ids the graph chose; ``ref``: [S, V] PyTorch's logits there."""
        top2 = np.partition(ref, -2, axis=-1)[:, -2:]
        gap = top2[:, 1] - top2[:, 0]
        tie = gap < NEAR_TIE * np.maximum(1.0, _magnitude(ref))
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


def _kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    entry = cache.layers[layer] if hasattr(cache, "layers") else None
    return (entry.keys, entry.values) if entry is not None else cache[layer]


def validate_model(
    model: torch.nn.Module,
    bundle: Path,
    dynamic: tuple[str, GraphSpec],
    static: tuple[str, GraphSpec],
    kv: tuple[int, int, int, int, str],
    seed: int = 0,
    rounds: int = 6,
    text: tuple[int, ...] = (),
) -> dict[str, float]:
    """Max |Δ| per output and top-1 agreement of the ``dynamic`` + ``static`` graphs against ``model``.

    Args:
        kv: (layers, kv_heads, max_seq, head_dim, dtype) of the model's cache.
        text: real text in the model's tokens (``text_tokens``); () skips the text check.
    """
    from transformers import DynamicCache

    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    cache = KVCache(*kv)
    engines = {role: runner_for(bundle, name, spec, cache) for role, (name, spec) in (("dynamic", dynamic), ("static", static))}
    ref_cache = DynamicCache()
    seen = Agreement()

    def compare(ours: np.ndarray, ids: list[int]) -> None:
        with torch.no_grad():
            seen.logits(ours, model(torch.tensor([ids]), past_key_values=ref_cache, use_cache=True).logits[0].float().numpy())

    def keep(rows: int) -> None:  # crop to ``rows``: a negative count drops rows in 4.57 and 5.x alike (5.x refuses a positive one)
        if (drop := ref_cache.get_seq_length() - rows) > 0:
            ref_cache.crop(-drop)

    decode_like_the_loop(engines, cache, compare, rng, vocab, (5, 20), rounds, keep)
    kv_diffs = {"present_key": 0.0, "present_value": 0.0}
    kv_scale = 0.0
    n = cache.length
    for i in range(len(cache.keys)):
        for name, ours, ref in zip(kv_diffs, (cache.keys[i], cache.values[i]), _kv(ref_cache, i)):
            ref = ref[0].float().numpy()
            kv_diffs[name] = max(kv_diffs[name], float(np.abs(ours[0, :, :n] - ref).max()))
            kv_scale = max(kv_scale, float(np.abs(ref).max()))
    cache.rewind_to(0)
    greedy = greedy_rollouts(engines["dynamic"], cache, model, rng, vocab)
    on_text = text_agreement(engines["dynamic"], cache, model, text) if text else {}
    return {**seen.figures(), **kv_diffs, "kv_scale": kv_scale, **greedy, **on_text}


GREEDY_PROMPTS, GREEDY_STEPS = 3, 16


def text_tokens(tokenizer, max_seq: int) -> tuple[int, ...]:
    """``VALIDATION_TEXT`` in ``tokenizer``'s ids, at most VALIDATION_TOKENS and max_seq / 2; () without a tokenizer."""
    if tokenizer is None:
        return ()
    ids = tokenizer(VALIDATION_TEXT, add_special_tokens=False)["input_ids"]
    return tuple(int(i) for i in ids[: min(VALIDATION_TOKENS, max_seq // 2)])


def text_agreement(engine, cache: KVCache, model: torch.nn.Module, ids: tuple[int, ...]) -> dict[str, float]:
    """The dynamic graph on real text, teacher-forced from an empty cache, against PyTorch:
    top-1 agreement (near-ties excepted) and mean KL(PyTorch || graph) in nats over its positions."""
    from specdec.divergence import kl
    from specdec.runtime.sampling import log_softmax

    cache.rewind_to(0)
    ours = engine.run(np.asarray(ids, dtype=np.int64)).copy()  # [n, V]
    cache.rewind_to(0)
    with torch.no_grad():
        ref = model(torch.tensor([list(ids)])).logits[0].float().numpy()
    seen = Agreement()
    seen.tokens(ours.argmax(-1), ref)
    return {"text_positions": len(ids), "text_top1": seen.agree / max(1, seen.counted),
            "text_kl": float(kl(log_softmax(ref), log_softmax(ours)).mean())}  # fmt: skip


def greedy_rollouts(engine, cache: KVCache, model: torch.nn.Module, rng: np.random.Generator, vocab: int,
                    prompts: int = GREEDY_PROMPTS, steps: int = GREEDY_STEPS) -> dict[str, int]:  # fmt: skip
    """Greedy decoding, several steps on several random prompts: the graph (one token per call,
    feeding back its own choices) against PyTorch's argmax loop (feeding back its own). Each
    rollout stops at its first near-tie (the two may then part legitimately). Returns the steps
    compared, the rollouts stopped at a near-tie, and the steps that chose another token."""
    from transformers import DynamicCache

    compared = tied = wrong = 0
    for _ in range(prompts):
        cache.rewind_to(0)
        prompt = rng.integers(0, vocab, size=int(rng.integers(4, 12))).tolist()
        ours_ids, ref_ids, ref_cache = prompt, prompt, DynamicCache()
        for _ in range(steps):
            ours = engine.run(ours_ids)[-1]
            cache.append(len(ours_ids))
            with torch.no_grad():
                ref = model(torch.tensor([ref_ids]), past_key_values=ref_cache, use_cache=True).logits[0, -1].float().numpy()
            top2 = np.partition(ref, -2)[-2:]
            if top2[1] - top2[0] < NEAR_TIE * max(1.0, float(_magnitude(ref[None])[0])):
                tied += 1
                break
            compared += 1
            mine, theirs = int(ours.argmax()), int(ref.argmax())
            if mine != theirs:
                wrong += 1
                break
            ours_ids, ref_ids = [mine], [theirs]
    cache.rewind_to(0)
    return {"greedy_steps": compared, "greedy_near_ties": tied, "greedy_mismatches": wrong}


def decode_like_the_loop(engines: dict, cache: KVCache, compare, rng: np.random.Generator, vocab: int, prompt_sizes: tuple[int, int],
                         rounds: int, committed) -> None:  # fmt: skip
    """Drive a model's ``engines`` ("dynamic", "static") as decoding does: a random prompt
    through the dynamic graph, then ``rounds`` static calls of random tokens, each followed by a
    partial acceptance and sometimes a deeper rewind. ``compare(logits, ids)`` checks each call
    against PyTorch; ``committed(n)`` tells the reference that n rows are now committed."""
    prompt = rng.integers(0, vocab, size=int(rng.integers(*prompt_sizes))).tolist()
    compare(engines["dynamic"].run(prompt).copy(), prompt)
    cache.append(len(prompt))
    step = engines["static"].capacity
    for r in range(rounds):
        ids = rng.integers(0, vocab, size=step).tolist()
        compare(engines["static"].run(ids).copy(), ids)
        cache.append(int(rng.integers(1, step + 1)))  # partial acceptance
        if r % 3 == 2 and cache.length > len(prompt) + 1:
            cache.rewind_to(cache.length - 1)  # a draft-style rollback of committed rows
        committed(cache.length)


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


def validate_tree(model: torch.nn.Module, bundle: Path, graph: tuple[str, GraphSpec], dynamic: tuple[str, GraphSpec],
                  kv: tuple[int, int, int, int, str], seed: int = 0, rounds: int = 4) -> dict[str, float]:  # fmt: skip
    """The tree verify graph as decoding will drive it: a random prompt through the dynamic graph,
    then rounds of a random tree (topological, siblings sharing positions, a repeated sibling),
    each node's logits against PyTorch on the node's own root-to-node path, and a random
    root-to-node path kept (``KVCache.keep``) before the next round; at the end, the committed
    KV rows against PyTorch's cache over the whole kept sequence."""
    from transformers import DynamicCache

    from specdec.engines.ort import RUNNERS, TreeRunner

    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    cache = KVCache(*kv)
    prefill = RUNNERS[dynamic[1].flavour](open_session(bundle, *dynamic), dynamic[0], dynamic[1], cache)
    tree = TreeRunner(open_session(bundle, *graph), graph[0], graph[1], cache)
    seen = Agreement()
    ids = rng.integers(0, vocab, size=int(rng.integers(5, 12))).tolist()
    prefill.run(ids)
    cache.append(len(ids))
    for _ in range(rounds):
        n = int(rng.integers(2, tree.capacity + 1))
        parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]  # each node under the root or an earlier node
        tokens = rng.integers(0, vocab, size=n).tolist()
        siblings = [i for i in range(1, n) if parents[i] == parents[i - 1]]
        if siblings:
            tokens[siblings[0]] = tokens[siblings[0] - 1]  # a sibling repeating a token
        ours = tree.run_tree(tokens, parents).copy()  # [n, V]
        paths = []
        for i in range(n):
            path, j = [], i
            while j >= 0:
                path.insert(0, j)
                j = parents[j]
            paths.append(path)
            with torch.no_grad():
                ref = model(torch.tensor([ids + [tokens[k] for k in path]])).logits[0, -1:].float().numpy()
            seen.logits(ours[i : i + 1], ref)
        kept = paths[int(rng.integers(0, n))]
        cache.keep(kept)
        ids += [tokens[k] for k in kept]
    with torch.no_grad():
        ref_cache = DynamicCache()
        model(torch.tensor([ids]), past_key_values=ref_cache, use_cache=True)
    kv_diffs, kv_scale = {"present_key": 0.0, "present_value": 0.0}, 0.0
    for i in range(len(cache.keys)):
        for name, ours_kv, ref in zip(kv_diffs, (cache.keys[i], cache.values[i]), _kv(ref_cache, i)):
            ref = ref[0].float().numpy()
            kv_diffs[name] = max(kv_diffs[name], float(np.abs(ours_kv[0, :, : cache.length] - ref).max()))
            kv_scale = max(kv_scale, float(np.abs(ref).max()))
    return {**seen.figures(), **kv_diffs, "kv_scale": kv_scale}


def validate_batched(model: torch.nn.Module, bundle: Path, graph: tuple[str, GraphSpec], kv: tuple[int, int, int, int, str],
                     max_tokens: int, seed: int = 0, rounds: int = 4, encoder: tuple[str, GraphSpec] | None = None,
                     max_source: int = 0) -> dict[str, float]:  # fmt: skip
    """Max |Δ logits| and top-1 agreement of a batched graph against ``model`` run row by row.

    Every row gets its own random prompt (different lengths, fed through the batched graph in
    one padded call), then ``rounds`` calls of 1..``max_tokens`` random tokens per row with
    partial acceptance; each row is compared with PyTorch on that row's own sequence. A rows
    graph (export/rows.py) is checked so for each of its row counts, over the same session.
    An encoder-decoder's (``encoder``: its batched encoder graph): each row also gets its own
    random source of its own length, every slot's encoded at once through ``encoder`` (padded
    and masked, so it is checked too), and PyTorch runs that source too.
    """
    from specdec.engines.batch import BatchRunner, SlotCache, slot_sources
    from specdec.engines.ort import BatchEncoder

    name, spec = graph
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    layers, heads, max_seq, dim, dtype = kv
    cache = SlotCache(layers, heads, max_seq, dim, dtype, spec.batch)
    prompt_max = max(2, min(20, max_seq // 4))
    cross = slot_sources(layers, heads, max_source, dim, dtype, spec.batch) if encoder else None
    runner = BatchRunner(open_session(bundle, name, spec), name, spec, cache, max(max_tokens, prompt_max), cross=cross)
    enc = BatchEncoder(open_session(bundle, *encoder), *encoder, spec.batch, max_source) if encoder else None
    sources: list[list[int]] = [[] for _ in range(spec.batch)]
    seen = Agreement()

    def reference(b: int) -> torch.Tensor:
        if enc is None:
            return model(torch.tensor([seqs[b]])).logits
        return model(input_ids=torch.tensor([sources[b]]), decoder_input_ids=torch.tensor([seqs[b]])).logits

    for rows in runner.sizes:
        for b in range(spec.batch):
            cache.rewind_to(b, 0)
            if enc is not None:
                sources[b] = rng.integers(0, vocab, size=int(rng.integers(2, min(max_source, 24) + 1))).tolist()
        if enc is not None:
            enc.run([np.array(src) for src in sources], cross[: spec.batch])
        seqs = [rng.integers(0, vocab, size=int(rng.integers(2, prompt_max + 1))).tolist() for _ in range(rows)]
        feeds = seqs
        for r in range(rounds + 1):
            out = runner.run(range(rows), [np.array(f) for f in feeds]).copy()
            for b, f in enumerate(feeds):
                with torch.no_grad():
                    ref = reference(b)[0, -len(f):].float().numpy()
                seen.logits(out[b, : len(f)], ref)
                keep = len(f) if r == 0 else int(rng.integers(1, len(f) + 1))  # partial acceptance after the prompt
                cache.slot(b).append(keep)
                del seqs[b][len(seqs[b]) - len(f) + keep :]
            feeds = [rng.integers(0, vocab, size=int(rng.integers(1, max_tokens + 1))).tolist() for _ in range(rows)]
            for b in range(rows):
                seqs[b] += feeds[b]
    # The KV rows are checked through the logits of every later call, which read them.
    return {**seen.figures(), "present_key": None, "present_value": None}


# Rows of a fused sampling graph's validation cycle through these settings (one greedy).
FUSED_SETTINGS = ((1.0, None, None), (0.7, 5, None), (1.0, None, 0.8), (0.0, None, None))


def validate_fused(model: torch.nn.Module, bundle: Path, graph: tuple[str, GraphSpec], dynamic: tuple[str, GraphSpec],
                   kv: tuple[int, int, int, int, str], seed: int = 0, rounds: int = 4) -> dict[str, float]:  # fmt: skip
    """A fused draft graph (export/fused.py) against ``model`` run on each row's own sequence.

    Each row's prompt is fed through the model's ``dynamic`` graph; then ``rounds`` fused calls,
    each followed by a partial acceptance (keep 0..γ-1 drafted tokens and a random next token),
    so every later call reads rows an earlier call wrote and crosses a rollback. Figures:
    ``top1_agreement``, the share of drafted tokens that are the argmax of PyTorch's logits
    (greedy rows) or the inverse CDF of the graph's own q at the row's uniform (sampled rows);
    ``logits``, the largest |Δ| between a sampled row's q and ``runtime.sampling.standardize``
    of PyTorch's logits (the NumPy core's law) under temperature, top-k and top-p.
    """
    from specdec.engines.batch import SlotCache
    from specdec.engines.fused import FusedRunner
    from specdec.runtime.sampling import SamplingConfig, standardize

    name, spec = graph
    rng = np.random.default_rng(seed)
    vocab, rows, gamma = model.config.vocab_size, spec.batch, spec.tokens
    layers, heads, max_seq, dim, dtype = kv
    cache = SlotCache(layers, heads, max_seq, dim, dtype, rows)
    prefill = runner_for(bundle, dynamic[0], dynamic[1], cache.slot(0))
    runner = FusedRunner(open_session(bundle, name, spec), name, spec, cache.slot, cache.scratch)
    prompt_max = max(3, min(20, max_seq // 4))
    seqs = [rng.integers(0, vocab, size=int(rng.integers(3, prompt_max + 1))).tolist() for _ in range(rows)]
    for b, seq in enumerate(seqs):
        prefill.bind_cache(cache.slot(b))
        prefill.run(np.array(seq[:-1]))
        cache.slot(b).append(len(seq) - 1)
    worst, seen = 0.0, Agreement()
    for r in range(rounds):
        cfgs = [SamplingConfig(*FUSED_SETTINGS[(r + b) % len(FUSED_SETTINGS)]) if runner.sampling else None for b in range(rows)]
        rngs = [np.random.default_rng([seed, r, b]) for b in range(rows)]
        tokens = runner.run(range(rows), [s[-1] for s in seqs], cfgs, rngs).copy()
        for b, seq in enumerate(seqs):
            drafted = tokens[b].tolist()
            with torch.no_grad():
                ref = model(torch.tensor([seq + drafted[:-1]])).logits[0, -gamma:].double().numpy()  # [γ, V]
            cfg = cfgs[b]
            if cfg is None or cfg.greedy:
                seen.tokens(tokens[b], ref)
            else:
                q = runner.probs[b]  # [γ, V]
                worst = max(worst, float(np.abs(q - standardize(ref, cfg)).max()))
                cdf = np.cumsum(q, axis=-1, dtype=np.float32)
                idx = (cdf <= runner.uniforms[b, :, None] * cdf[:, -1:]).sum(-1)
                drawn = np.minimum(idx, vocab - 1 - np.argmax(q[:, ::-1] > 0, axis=-1))
                seen.matches(drawn == tokens[b])  # the draw from the graph's own q: no near-ties here
            keep = int(rng.integers(0, gamma))  # drafted tokens accepted, then the target's own token
            seqs[b] = seq + drafted[:keep] + [int(rng.integers(0, vocab))]
            cache.slot(b).append(1 + keep)
    # q rows are probabilities: their scale is 1, so the float32 bound is 1e-4 absolute.
    return {**seen.figures(), "logits": worst if runner.sampling else None, "logits_scale": 1.0 if runner.sampling else None,
            "present_key": None, "present_value": None}  # fmt: skip


def validate_seq2seq(model: torch.nn.Module, bundle: Path, encoder: tuple[str, GraphSpec], dynamic: tuple[str, GraphSpec],
                     static: tuple[str, GraphSpec], kv: tuple[int, int, int, int, str], max_source: int, seed: int = 0,
                     rounds: int = 6) -> dict[str, float]:  # fmt: skip
    """An encoder-decoder's graphs (export/seq2seq.py) against ``model``, as ``validate_model``:
    a random source through the encoder graph, a random decoder prompt through the dynamic
    graph, then ``rounds`` static calls with partial acceptance and rollbacks. PyTorch runs the
    source and the whole decoder sequence so far at each call; the KV rows and the cross K/V are
    checked through the logits of every later call, which read them."""
    from specdec.engines.kv import CrossKV
    from specdec.engines.ort import EncoderRunner

    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    layers, heads, _, dim, dtype = kv
    cache, cross = KVCache(*kv), CrossKV(layers, heads, max_source, dim, dtype)
    enc = EncoderRunner(open_session(bundle, *encoder), *encoder, cross)
    engines = {role: runner_for(bundle, name, spec, cache) for role, (name, spec) in (("dynamic", dynamic), ("static", static))}
    source = rng.integers(0, vocab, size=int(rng.integers(2, min(max_source, 24) + 1))).tolist()
    enc.run(np.array(source))
    for e in engines.values():
        e.bind_cross(cross)
    seq: list[int] = []
    seen = Agreement()

    def compare(ours: np.ndarray, ids: list[int]) -> None:
        seq.extend(ids)
        with torch.no_grad():
            seen.logits(ours, model(input_ids=torch.tensor([source]), decoder_input_ids=torch.tensor([seq])).logits[0, -len(ids):].float().numpy())

    decode_like_the_loop(engines, cache, compare, rng, vocab, (2, 10), rounds, lambda n: seq.__delitem__(slice(n, None)))
    return {**seen.figures(), "present_key": None, "present_value": None}

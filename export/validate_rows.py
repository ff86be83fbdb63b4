"""Export-time validation of the graphs that run many rows per call: batched (and rows) graphs
and fused draft graphs, each row against PyTorch on that row's own sequence."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specdec.engines.ort import runner_for
from specdec.engines.sessions import open_session
from specdec.export.agreement import Agreement
from specdec.manifest import GraphSpec


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

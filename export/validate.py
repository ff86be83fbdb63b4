"""Export-time validation: the exported graphs, run by the runtime's own engine, against PyTorch.

For one model: a random prompt through the dynamic-length graph, then several calls of the static graph
(S = K for the target's verify graph, 1 for the draft's step graph) with random tokens, each
followed by a partial acceptance (keep 1..S rows) and sometimes a deeper rewind, exactly as
the decoding loop rolls back. PyTorch runs the same tokens with a DynamicCache cropped to the
same length. Every call's logits and, at the end, the committed KV rows are compared.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specdec.engines.kv import KVCache
from specdec.engines.ort import runner_for
from specdec.engines.sessions import open_session
from specdec.export.agreement import GREEDY_PROMPTS, GREEDY_STEPS, NEAR_TIE, Agreement, magnitude
from specdec.export.agreement import BROKEN_TOP1, TOLERANCES, Tolerance, check, text_tokens, tolerance  # noqa: F401 - importable here as before
from specdec.manifest import GraphSpec


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
            if top2[1] - top2[0] < NEAR_TIE * max(1.0, float(magnitude(ref[None])[0])):
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

"""Structured outputs under speculation: the output is the target's own under the grammar's mask.

Greedy: token for token against a PyTorch argmax loop over the target's logits masked by a
fresh llguidance matcher (its own numpy helpers, not runtime/constraints.py's), for every
drafter, one request and a batch. Sampling: first-two-token marginals of thousands of seeded
requests against the masked target's exact law (chi-square). Every JSON output is parsed and
validated with ``jsonschema``. Bad and hostile specs are refused with one line, in bounded time.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from specdec.errors import InputError
from specdec.runtime import SamplingConfig, SpeculativeDecoder
from specdec.runtime.batch import BatchEngine
from specdec.runtime.constraints import StructuredOutputs
from specdec.runtime.sampling import standardize

torch = pytest.importorskip("torch")
llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
from llguidance.numpy import allocate_token_bitmask, apply_token_bitmask_inplace, fill_next_token_bitmask  # noqa: E402
from test_decoder_exact import check_first_two, first_diff, load_model  # noqa: E402

LLAMA = pytest.mark.parametrize("family_bundle", ["llama"], indirect=True)
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 999},
                   "tag": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["name", "n", "tag", "ok"],
    "additionalProperties": False,
}  # fmt: skip
SPECS = {
    "json": StructuredOutputs(json=SCHEMA),
    "regex": StructuredOutputs(regex=r"[a-z]{2,6}-[0-9]{1,3}( [a-z]{1,4}){0,3}"),
    "choice": StructuredOutputs(choice=["def", "class", "return value", "import os"]),
    "lark": StructuredOutputs(grammar='start: item ("," item)*\nitem: /[a-z]{1,5}/ | NUMBER\nNUMBER: /[0-9]{1,3}/'),
}
PROMPTS = [[5, 17, 42, 99, 7, 3], [200], [31, 31, 31, 64, 128, 250, 12, 9]]
NEW = 60


def masked_argmax_loop(model, dec, prompt: list[int], spec: StructuredOutputs, n: int) -> list[int]:
    """The target's greedy output under ``spec``: a plain argmax loop over HF's KV cache, each
    row masked by a matcher advanced one emitted token at a time (llguidance's numpy helpers);
    ends at the first EOS, as the engine does."""
    from transformers import DynamicCache

    grammars = dec.codec.grammars(dec.limits)
    matcher = grammars.matcher(spec)  # a fresh copy of the compiled grammar
    bits = allocate_token_bitmask(1, dec.manifest.vocab_size)
    cache, out, ids = DynamicCache(), [], torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            logits = model(ids, past_key_values=cache, use_cache=True).logits[0, -1].double().numpy()[None]  # [1, V]
            fill_next_token_bitmask(matcher, bits)
            if not bits.any():  # nothing allowed: the grammar is done, EOS ends it (the engine's rule)
                bits[0, 0] |= 1 << dec.manifest.eos_token_ids[0]
            apply_token_bitmask_inplace(logits, bits)
            tok = int(logits[0].argmax())
            out.append(tok)
            if tok in dec.manifest.eos_token_ids:
                break
            assert matcher.consume_token(tok), matcher.get_error()
            ids = torch.tensor([[tok]])
    return out


def check_output(dec, tokens: list[int], spec: StructuredOutputs, finish: str) -> None:
    """A finished output matches its spec: JSON parses and validates, a choice is one of them."""
    if finish != "eos":
        return
    text = dec.codec.decode(tokens)
    if spec.kind == "json":
        jsonschema.validate(json.loads(text), spec.json)
    elif spec.kind == "choice":
        assert text in spec.choice, text


@LLAMA
@pytest.mark.parametrize("drafter", ["model", "model-steps", "lookup", "hierarchical", "ngram", "lookup-tree"])
def test_constrained_greedy_is_the_masked_argmax_for_every_drafter(family_bundle, drafter):
    family, target, _, out, manifest = family_bundle
    model = load_model(target)
    dec = SpeculativeDecoder.load(out, drafter=drafter)
    accepted = rejected = finished = 0
    for name, spec in SPECS.items():
        for prompt in PROMPTS:
            ref = masked_argmax_loop(model, dec, prompt, spec, NEW)
            for gamma in (4, 2) if drafter in ("model", "lookup-tree") else (3,):
                res = dec.generate(prompt, max_new_tokens=NEW, gamma=gamma, structured_outputs=spec)
                assert res.tokens == ref, f"{drafter} {name} γ={gamma} prompt={prompt}: first difference at {first_diff(res.tokens, ref)}"
                check_output(dec, res.tokens, spec, res.stats.finish_reason)
                finished += res.stats.finish_reason == "eos"
                accepted, rejected = accepted + res.stats.accepted, rejected + res.stats.rejected
    assert finished >= 6, finished  # most specs end inside NEW tokens (the outputs were checked)
    assert accepted > 20 and (rejected > 5 or drafter in ("lookup", "lookup-tree")), (accepted, rejected)


@LLAMA
def test_constrained_rows_beside_free_rows_in_a_batch(family_bundle):
    """Constrained and free rows share the engine's calls: each keeps its own output (the
    constrained ones the masked argmax, the free one the plain decoder's)."""
    family, target, _, out, manifest = family_bundle
    model = load_model(target)
    dec = SpeculativeDecoder.load(out)
    jobs = [(p, name) for p in PROMPTS for name in SPECS] + [(PROMPTS[0], None)]
    with BatchEngine(out) as engine:
        handles = [engine.submit(p, max_new_tokens=NEW, structured_outputs=SPECS.get(name)) for p, name in jobs]
        results = [h.result(timeout=300) for h in handles]
        assert max(engine.occupancy) == manifest.max_batch
    for (p, name), res in zip(jobs, results):
        ref = masked_argmax_loop(model, dec, p, SPECS[name], NEW) if name else dec.generate(p, max_new_tokens=NEW).tokens
        assert res.tokens == ref, f"{name} prompt={p}: first difference at {first_diff(res.tokens, ref)}"
        if name:
            check_output(dec, res.tokens, SPECS[name], res.stats.finish_reason)


def exact_masked_first_two(model, dec, prompt: list[int], spec: StructuredOutputs, cfg: SamplingConfig):
    """P(t1) and P(t2) of the target under ``spec`` and ``cfg``: mask, then standardize."""
    grammars = dec.codec.grammars(dec.limits)
    bits = allocate_token_bitmask(1, dec.manifest.vocab_size)

    def masked(matcher, logits):
        fill_next_token_bitmask(matcher, bits)
        row = logits.double().numpy()[None].copy()
        apply_token_bitmask_inplace(row, bits)
        return standardize(row[0], cfg)

    with torch.no_grad():
        first = grammars.matcher(spec)
        p1 = masked(first, model(torch.tensor([prompt])).logits[0, -1])  # [V]
        support = np.flatnonzero(p1)
        rows = model(torch.tensor([prompt + [int(t)] for t in support])).logits[:, -1]
        p2 = np.zeros_like(p1)
        for t, logits in zip(support, rows):
            m = grammars.matcher(spec)
            assert m.consume_token(int(t))
            p2 += p1[t] * masked(m, logits)
    return p1, p2


@LLAMA
@pytest.mark.parametrize("name", ["regex", "json"])
def test_sampled_constrained_tokens_follow_the_masked_target(family_bundle, name):
    """Chi-square of the first two tokens of 3000 seeded requests (the model drafter at γ = 4,
    batched) against the target's masked law at T = 1. P_MIN as in test_decoder_exact."""
    family, target, _, out, _ = family_bundle
    # a JSON value whose first two tokens are free (an object's are forced: '{"', its first key)
    free_json = StructuredOutputs(json={"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99999}, {"type": "string", "maxLength": 6}]})
    spec, runs = SPECS[name] if name == "regex" else free_json, 3000
    dec = SpeculativeDecoder.load(out)
    p1, p2 = exact_masked_first_two(load_model(target), dec, PROMPTS[2], spec, SamplingConfig(1.0))
    with BatchEngine(out, max_queue=runs) as engine:
        handles = [engine.submit(PROMPTS[2], max_new_tokens=6, temperature=1.0, seed=s, gamma=4, structured_outputs=spec) for s in range(runs)]
        results = [h.result(timeout=600) for h in handles]
    check_first_two(results, p1, p2, (0.05, 0.98), f"{name} T=1")


FORCED = StructuredOutputs(json={"type": "object", "properties": {"alpha_key": {"enum": ["one", "two"]}, "beta_key_long": {"type": "boolean"}},
                                 "required": ["alpha_key", "beta_key_long"], "additionalProperties": False})  # fmt: skip


@LLAMA
@pytest.mark.parametrize("drafter, gamma", [("lookup", 0), ("lookup-tree", 0), ("lookup-tree", 4)])
def test_forced_tokens_are_drafted_by_the_grammar(family_bundle, drafter, gamma):
    """Without a drafter (γ = 0), or in place of a tree drafter's tree, a schema's forced spans
    (braces, keys) come several per target call, as one chain; the output is still the masked
    argmax. (The feature tree's: tests/runtime/test_tree_decoding.py.)"""
    family, target, _, out, _ = family_bundle
    model = load_model(target)
    dec = SpeculativeDecoder.load(out, drafter=drafter)
    spec = FORCED
    res = dec.generate(PROMPTS[0], max_new_tokens=NEW, gamma=gamma, structured_outputs=spec)
    assert res.tokens == masked_argmax_loop(model, dec, PROMPTS[0], spec, NEW)
    assert res.stats.finish_reason == "eos"
    jsonschema.validate(json.loads(dec.codec.decode(res.tokens)), spec.json)
    assert res.stats.target_calls < 0.6 * len(res.tokens), res.stats  # forced spans came many per call
    assert res.stats.accepted >= 5


@LLAMA
def test_length_inside_a_structure_and_bad_specs(family_bundle):
    out = family_bundle[3]
    dec = SpeculativeDecoder.load(out)
    res = dec.generate(PROMPTS[0], max_new_tokens=3, structured_outputs=SPECS["json"])
    assert res.stats.finish_reason == "length" and len(res.tokens) == 3
    bad = [
        (dict(json="{not json"), "not valid JSON"),
        (dict(json={"type": "object"}, regex="a"), "exactly one of"),
        (dict(), "exactly one of"),
        (dict(regex="(unclosed"), "regex"),
        (dict(grammar="start: undefined_rule"), "grammar"),
        (dict(choice=[]), "choice"),
        (dict(json={"type": "no-such-type"}), "json"),
        (dict(json={"type": "array", "items": {"type": "integer"}, "uniqueItems": True}), "remove those keywords"),
    ]
    for fields, words in bad:
        with pytest.raises(InputError, match=words) as e:
            dec.generate(PROMPTS[0], max_new_tokens=5, structured_outputs=fields)
        assert "\n" not in str(e.value)
    with pytest.raises(InputError, match="ignore_eos"):
        dec.generate(PROMPTS[0], max_new_tokens=5, ignore_eos=True, structured_outputs={"regex": "a+"})


@LLAMA
def test_hostile_specs_are_bounded(family_bundle):
    """Deep nesting, a huge enum and a catastrophic-backtracking regex either compile and
    decode or are refused with one line, each within seconds (the engine never stalls)."""
    out = family_bundle[3]
    dec = SpeculativeDecoder.load(out)
    deep: dict = {"type": "string"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    hostile = {
        "deep": dict(json=deep),
        "enum": dict(json={"enum": [f"value-{i}-{'x' * (i % 17)}" for i in range(3000)]}),
        "backtracking": dict(regex="(a+)+$"),
        "alternation": dict(regex="(" + "|".join(f"w{i}x{i * 7}" for i in range(2000)) + ")"),
    }
    for name, fields in hostile.items():
        t0 = time.perf_counter()
        try:
            res = dec.generate(PROMPTS[0], max_new_tokens=8, structured_outputs=fields)
            assert res.stats.new_tokens >= 1
        except InputError as e:
            assert "\n" not in str(e)
        assert time.perf_counter() - t0 < 20, name
    assert dec.generate(PROMPTS[0], max_new_tokens=8, structured_outputs=SPECS["regex"]).tokens  # still decodes

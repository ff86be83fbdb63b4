"""The device-cache code path (what provider="cuda" runs), exercised on the CPU.

On CUDA every KV buffer is an OrtValue bound by pointer, never a NumPy array: slot copies,
row moves and prefix sharing cannot touch it from Python. Device "ortvalue" keeps host memory
the same way, so these tests run that path here, where CI has no GPU; tools/gpu/check.py runs
the same comparisons on a real GPU.
"""

from __future__ import annotations

import onnxruntime as ort
import pytest

from specdec.engines import ort as ort_engine
from specdec.errors import EngineError
from specdec.runtime import SpeculativeDecoder
from specdec.runtime.batch import BatchEngine

LLAMA = pytest.mark.parametrize("family_bundle", ["llama"], indirect=True)
PROMPTS = [[5, 9, 13, 2, 7], [11, 3, 3, 8], [5, 9, 13, 2, 7, 21, 4], [30, 31, 32]]  # two share a prefix
CHAIN_DRAFTERS = ["model", "model-steps", "hierarchical", "lookup"]


def _decode(bundle, drafter: str, temperature: float) -> list[list[int]]:
    dec = SpeculativeDecoder.load(bundle, drafter=drafter)
    return [dec.generate(p, max_new_tokens=24, ignore_eos=True, temperature=temperature, seed=3).tokens for p in PROMPTS]


def _batch(bundle) -> list[list[int]]:
    with BatchEngine(bundle, max_batch=4) as engine:
        return [r.tokens for r in engine.generate_many(PROMPTS, max_new_tokens=24, ignore_eos=True)]


@LLAMA
def test_device_buffers_decode_as_host_arrays(family_bundle, monkeypatch):
    """Every chain drafter, greedy and sampled with a seed, batch 1 and batched: the same tokens
    with the KV in OrtValues as in NumPy arrays."""
    bundle = family_bundle[3]
    host = {(d, t): _decode(bundle, d, t) for d in CHAIN_DRAFTERS for t in (0.0, 1.0)}
    host_batch = _batch(bundle)
    monkeypatch.setitem(ort_engine.DEVICE, "cpu", "ortvalue")
    dec = SpeculativeDecoder.load(bundle)
    assert isinstance(dec.engine.target.cache.slot(0).keys[0], ort.OrtValue)  # the path under test runs
    for (drafter, t), want in host.items():
        assert _decode(bundle, drafter, t) == want, (drafter, t)
    assert _batch(bundle) == host_batch


@LLAMA
def test_a_tree_drafter_on_device_buffers_is_refused_by_name(family_bundle, monkeypatch):
    """A tree keeps rows out of order, which moves KV rows; on device buffers that is refused at
    load with a typed error naming the fix, not a crash in the middle of a request."""
    monkeypatch.setitem(ort_engine.DEVICE, "cpu", "ortvalue")
    with pytest.raises(EngineError, match="chain drafter"):
        SpeculativeDecoder.load(family_bundle[3], drafter="lookup-tree")

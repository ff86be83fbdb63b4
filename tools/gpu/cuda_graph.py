"""An experiment for the GPU check: does ONNX Runtime's CUDA graph capture the target's one-token
call, does it keep the tokens, and what does it save?

At 135M on an H100 a call is bound by launching ~30 layers' kernels from the host (docs/gpu.md),
which a captured CUDA graph replays in one launch. ORT captures a session's graph on its first
run when the CUDA provider has ``enable_cuda_graph``, provided every input and output is bound
to the same buffers on every run. This stage decodes greedily with the target's batch-1 graph
(``target_dynamic`` at S = 1) three ways over one set of device KV buffers, the prompt fed first
by a plain session:

    plain       the same loop without capture (what the runtime's one-token calls cost)
    graph/cpu   captured; ``total_sequence_length`` (a CPU input of GroupQueryAttention) bound
                as a host OrtValue rewritten before each replay
    graph/max   captured; that total fixed at the cache's length (GQA's device ``seqlens_k``
                carries each call's length)

tools/gpu/check.py compares each one's tokens with the runtime's own autoregressive output on
CUDA. It is a measurement, not a runtime path: what it finds decides whether the runtime gets one.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np


def _buffers(spec, ort, vocab: int, device: str) -> dict:
    """Device OrtValues for every input and output of a one-token call (KV zeroed: docs/gpu.md)."""
    dt = {"float16": np.float16, "float32": np.float32, "int64": np.int64, "int32": np.int32}
    bufs = {}
    for t in spec.inputs:
        if t.name == spec.io.total:
            bufs[t.name] = ort.OrtValue.ortvalue_from_numpy(np.zeros((), np.int32))  # host: GQA reads it on the CPU
            continue
        shape = [1 if isinstance(d, str) else d for d in t.shape]  # S = 1
        bufs[t.name] = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dt[t.dtype]), device, 0)
    logits = next(t for t in spec.outputs if t.name == spec.io.logits)
    bufs[spec.io.logits] = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, 1, vocab), dt[logits.dtype]), device, 0)
    return bufs


def _binding(session, spec, bufs):
    b = session.io_binding()
    for t in spec.inputs:
        b.bind_ortvalue_input(t.name, bufs[t.name])
    b.bind_ortvalue_output(spec.io.logits, bufs[spec.io.logits])
    for (pk, pv), (ok, ov) in zip(spec.io.past, spec.io.present):  # present written in place over past
        b.bind_ortvalue_output(ok, bufs[pk])
        b.bind_ortvalue_output(ov, bufs[pv])
    return b


def _prefill(plain, spec, bufs, prompt: list[int]) -> int:
    """Feed the prompt with a plain session into ``bufs``' KV; returns the first greedy token."""
    n = len(prompt)
    feeds = {spec.io.ids: np.array([prompt], np.int64), spec.io.positions: np.arange(n, dtype=np.int64)[None],
             spec.io.seqlens: np.array([n - 1], np.int32), spec.io.total: np.array(n, np.int32)}  # fmt: skip
    b = plain.io_binding()
    for name, value in feeds.items():
        b.bind_cpu_input(name, value)
    for pk, pv in spec.io.past:
        b.bind_ortvalue_input(pk, bufs[pk])
        b.bind_ortvalue_input(pv, bufs[pv])
    b.bind_output(spec.io.logits, "cpu")
    for (pk, pv), (ok, ov) in zip(spec.io.past, spec.io.present):
        b.bind_ortvalue_output(ok, bufs[pk])
        b.bind_ortvalue_output(ov, bufs[pv])
    plain.run_with_iobinding(b)
    return int(np.argmax(b.copy_outputs_to_cpu()[0][0, -1]))


def _decode(session, spec, bufs, binding, prompt: list[int], first: int, tokens: int, total_max: int | None) -> tuple[list[int], float]:
    """Greedy one-token calls from ``first`` on: ids, position and lengths written into the bound
    buffers before each run; returns the tokens and the seconds of the loop."""
    out, n, tok = [first], len(prompt), first
    t = time.perf_counter()
    for i in range(tokens - 1):
        pos = n + i  # this token's position; rows visible after the call: pos + 1
        bufs[spec.io.ids].update_inplace(np.array([[tok]], np.int64))
        bufs[spec.io.positions].update_inplace(np.array([[pos]], np.int64))
        bufs[spec.io.seqlens].update_inplace(np.array([pos], np.int32))
        bufs[spec.io.total].update_inplace(np.array(total_max if total_max else pos + 1, np.int32))
        session.run_with_iobinding(binding)
        tok = int(np.argmax(bufs[spec.io.logits].numpy()[0, -1]))
        out.append(tok)
    return out, time.perf_counter() - t


def cuda_graph_ar(bundle: Path, prompts: list[list[int]], tokens: int, device: str = "cuda") -> dict:
    """Each variant's greedy tokens per prompt and its time per token (or the error ORT raised).
    ``device="cpu"``: the same loops on the CPU provider, where nothing is captured (the harness's
    own test, tests/tools/test_gpu_tools.py)."""
    import onnxruntime as ort

    from specdec.engines.ort import _preload_cuda
    from specdec.manifest import load_manifest

    _preload_cuda()
    m = load_manifest(bundle, "size")
    spec = m.graphs["target_dynamic"]
    path = str(bundle / spec.file)
    def providers(**options) -> list:
        return [("CUDAExecutionProvider", {"use_tf32": "0", **options}), "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]

    plain = ort.InferenceSession(path, providers=providers())
    max_seq = next(t for t in spec.inputs if t.name == spec.io.past[0][0]).shape[2]
    out: dict = {"graph": "target_dynamic", "prompts": len(prompts), "tokens": tokens, "variants": {}}
    for variant, total_max, capture in (("plain", None, False), ("graph/cpu", None, True), ("graph/max", max_seq, True)):
        try:
            session = ort.InferenceSession(path, providers=providers(enable_cuda_graph="1")) if capture else plain
            bufs = _buffers(spec, ort, m.vocab_size, device)
            binding = _binding(session, spec, bufs)
            got, seconds = [], 0.0
            for p in prompts:  # the same buffers for every prompt: a captured graph keeps its addresses
                toks, s = _decode(session, spec, bufs, binding, p, _prefill(plain, spec, bufs, p), tokens, total_max)
                got.append(toks)
                seconds += s
            calls = len(prompts) * (tokens - 1)
            row = {"tok_s": round(calls / seconds, 1), "ms_per_token": round(1e3 * seconds / calls, 3), "tokens": got}
        except Exception as e:  # a variant ORT refuses is a finding, not the end of the stage
            row = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        out["variants"][variant] = row
    return out

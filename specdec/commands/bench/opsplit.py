"""Where a decoder call's time goes: ONNX Runtime's node profile, split into MatMul, attention
and everything else.

At batch 1 the weight MatMuls are bound by memory bandwidth (``floor.py``); what a call spends
beyond them is per-op overhead: norms, Splits, Reshapes, activations, attention's bookkeeping.
``profile_calls`` runs one model's dynamic-length graph over a KV cache of ``context`` rows,
``calls`` times at ``tokens`` tokens a call, with ORT's profiler on, and ``split`` sums the
kernel times of the calls per op type (the first call, a warm-up, and the prefill are left out).

    specdec bench BUNDLE --op-split          # prints it for the target, then benches as usual
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MATMUL_OPS = frozenset({"MatMul", "MatMulNBits", "MatMulBlocks", "FusedMatMul", "MatMulInteger", "DynamicQuantizeMatMul", "Gemm", "MatMulIntegerToFloat"})
ATTENTION_OPS = frozenset({"GroupQueryAttention", "MultiHeadAttention", "Attention"})


def group_of(op: str) -> str:
    return "matmul" if op in MATMUL_OPS else "attention" if op in ATTENTION_OPS else "other"


@dataclass
class OpSplit:
    """Mean milliseconds per call: per op type (with its node count per call) and per group."""

    graph: str
    tokens: int
    calls: int
    call_ms: float  # the run's wall time per call, as the profiler saw it (model_run)
    ops: dict[str, tuple[float, float]] = field(default_factory=dict)  # op type -> (ms per call, nodes per call)

    @property
    def groups(self) -> dict[str, float]:
        out = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
        for op, (ms, _) in self.ops.items():
            out[group_of(op)] += ms
        return out

    def lines(self) -> list[str]:
        g = self.groups
        kernels = sum(g.values())
        head = (f"{self.graph}, {self.tokens} token(s) a call, mean of {self.calls} calls: {self.call_ms:.2f} ms a call; "
                f"MatMul {g['matmul']:.2f} ms, attention {g['attention']:.2f} ms, other ops {g['other']:.2f} ms, "
                f"between kernels {max(self.call_ms - kernels, 0.0):.2f} ms")  # fmt: skip
        rows = sorted(self.ops.items(), key=lambda kv: -kv[1][0])
        return [head] + [f"  {op:<36} {ms:7.3f} ms  {n:5.0f} nodes  ({group_of(op)})" for op, (ms, n) in rows]

    def as_dict(self) -> dict:
        return {"graph": self.graph, "tokens": self.tokens, "calls": self.calls, "call_ms": round(self.call_ms, 4),
                "groups_ms": {k: round(v, 4) for k, v in self.groups.items()},
                "ops": {op: {"ms": round(ms, 4), "nodes": n} for op, (ms, n) in self.ops.items()}}  # fmt: skip


def split(events: list[dict], skip_runs: int, runs: int) -> tuple[dict[str, tuple[float, float]], float]:
    """Per op type (ms per run, nodes per run) and the mean ms of a run, over the ``runs`` model
    runs after the first ``skip_runs`` of an ORT profile's ``events``."""
    bounds = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    kept = bounds[skip_runs : skip_runs + runs]
    if len(kept) < runs:
        raise ValueError(f"the profile holds {len(bounds)} runs; expected {skip_runs + runs}")
    lo, hi = kept[0][0], kept[-1][1]
    total: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time") or not lo <= e["ts"] <= hi:
            continue
        acc = total.setdefault(e["args"].get("op_name", "?"), [0.0, 0])
        acc[0] += e["dur"]
        acc[1] += 1
    ops = {op: (us / 1000 / runs, n / runs) for op, (us, n) in total.items()}
    return ops, sum(b - a for a, b in kept) / 1000 / runs


def profile_events(bundle: Path, manifest, model: str, calls: list[tuple[int, int]], context: int, provider: str = "cpu",
                   threads=None) -> list[dict]:  # fmt: skip
    """ORT's profile events of ``model``'s dynamic graph over a KV cache on ``provider``'s device:
    a ``context``-token prefill, then for each (tokens, n) of ``calls`` n calls of that many
    tokens (each keeps one row, as a decode step does)."""
    import onnxruntime as ort

    from specdec.engines.kv import KVCache
    from specdec.engines.ort import GraphRunner
    from specdec.engines.sessions import DEVICE, PROVIDERS, check_signature
    from specdec.engines.threads import ThreadPolicy
    from specdec.errors import InputError

    name, spec = manifest.graph(model, "dynamic")
    m = getattr(manifest, model)
    if context + sum(t * n for t, n in calls) > manifest.max_seq_len:
        raise InputError(f"a {context}-token prefill and {calls} (tokens, calls) exceed the bundle's max-seq-len {manifest.max_seq_len}")
    with tempfile.TemporaryDirectory() as tmp:
        options = ThreadPolicy.of(threads).session_options()
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tmp) / "opsplit")
        session = ort.InferenceSession(str(Path(bundle) / spec.file), options, providers=PROVIDERS[provider])
        check_signature(name, session, spec)
        cache = KVCache(m.num_layers, m.num_kv_heads, manifest.max_seq_len, m.head_dim, manifest.dtype, DEVICE[provider])
        rng = np.random.default_rng(0)
        GraphRunner(session, name, spec, cache, tokens=context).run(rng.integers(0, manifest.vocab_size, context))
        cache.append(context)
        for tokens, n in calls:
            runner = GraphRunner(session, name, spec, cache, tokens=tokens)
            for _ in range(n):
                runner.run(rng.integers(0, manifest.vocab_size, tokens))
                cache.append(1)
        return json.loads(Path(session.end_profiling()).read_text())


def profile_calls(bundle: Path, manifest, model: str = "target", tokens: int = 1, calls: int = 32, context: int = 64,
                  threads=None) -> OpSplit:  # fmt: skip
    """Profile ``calls`` calls of ``tokens`` tokens of ``model``'s dynamic graph after a
    ``context``-token prefill (see the module docstring); a first call warms up, uncounted."""
    events = profile_events(bundle, manifest, model, [(tokens, calls + 1)], context, threads=threads)
    ops, call_ms = split(events, skip_runs=2, runs=calls)
    return OpSplit(manifest.graph(model, "dynamic")[0], tokens, calls, call_ms, ops)

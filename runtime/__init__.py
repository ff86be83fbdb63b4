"""specdec runtime: speculative decoding with NumPy and ONNX Runtime only (no torch).

``SpeculativeDecoder`` (and the ONNX Runtime import it brings) loads on first use, so the
pure-NumPy math here stays importable without onnxruntime.
"""

from specdec.runtime.analysis import (
    Plan,
    acceptance,
    alpha,
    dlk,
    expected_tokens,
    operations_factor,
    optimal_gamma,
    plan,
    walltime_improvement,
)
from specdec.runtime.request import Limits, Request
from specdec.runtime.sampling import GREEDY, SamplingConfig, sample, softmax, standardize
from specdec.runtime.speculative import Verdict, verify, verify_batch, verify_greedy, verify_greedy_batch

__all__ = [
    "BatchEngine",
    "Handle",
    "GREEDY",
    "GenerationResult",
    "Limits",
    "Piece",
    "Request",
    "SpeculativeDecoder",
    "Stats",
    "Stream",
    "ThreadPolicy",
    "Plan",
    "SamplingConfig",
    "Verdict",
    "acceptance",
    "alpha",
    "dlk",
    "expected_tokens",
    "operations_factor",
    "optimal_gamma",
    "plan",
    "sample",
    "softmax",
    "standardize",
    "verify",
    "verify_batch",
    "verify_greedy",
    "verify_greedy_batch",
    "walltime_improvement",
]


def __getattr__(name: str):
    if name in ("SpeculativeDecoder", "GenerationResult", "Piece", "Stream"):
        from specdec.runtime import decoder

        return getattr(decoder, name)
    if name == "Stats":
        from specdec.runtime.stats import Stats

        return Stats
    if name in ("BatchEngine", "Handle"):
        from specdec.runtime import batch, handles

        return getattr(batch if name == "BatchEngine" else handles, name)
    if name == "ThreadPolicy":
        from specdec.engines.threads import ThreadPolicy

        return ThreadPolicy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""specdec runtime: speculative decoding with NumPy and ONNX Runtime only (no torch)."""

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
from specdec.runtime.sampling import GREEDY, SamplingConfig, sample, softmax, standardize
from specdec.runtime.speculative import Verdict, verify, verify_batch, verify_greedy, verify_greedy_batch

__all__ = [
    "GREEDY",
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

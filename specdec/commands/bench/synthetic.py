"""Synthetic acceptance, for cost benchmarks only (issue 29; vLLM's synthetic rejection sampler
and TensorRT-LLM's forced acceptance play the same role).

On random-initialized models at deployment size (tools/make_sized_pair.py) acceptance means
nothing, yet what speculation costs there is the question. With ``enable(owner, A)`` the real
draft and verify graphs still run at full width and the real verification still runs, then each
draft token is kept with probability A (runtime/speculative.py ``synthetic_accept``). Every
request's ``Stats.synthetic`` says so, and its output is NOT the target's: nothing here feeds an
exactness claim. Only ``specdec bench`` and ``specdec bench-batch`` call this; ``generate``,
``submit`` and the server have no field that reaches it (``SamplingParams`` refuses one).
"""

from __future__ import annotations

import math

from specdec.errors import ConfigError


def check_rate(rate: float) -> float:
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and 0 <= rate <= 1):
        raise ConfigError(f"--synthetic-acceptance {rate!r}: expected a probability in [0, 1]")
    return float(rate)


def enable(owner, rate: float) -> None:
    """Put a ``SpeculativeDecoder`` or a ``BatchEngine`` (``owner.engine``) in synthetic mode."""
    rate, engine = check_rate(rate), owner.engine
    if getattr(engine.proposer, "tree", False):
        raise ConfigError(f"--synthetic-acceptance with drafter {engine.proposer.name!r}: synthetic acceptance is "
                          "defined for chains (i.i.d. per draft token); use a chain drafter")
    engine.synthetic = rate


def banner(rate: float) -> str:
    """The first line of every report made with synthetic acceptance."""
    return (f"SYNTHETIC: each draft token kept with probability {rate:g} whatever the target says (cost only; "
            "outputs are NOT the target's; α is that coin's estimate)\n")

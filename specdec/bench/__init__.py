"""Benchmarks of a bundle (``specdec bench``): held-out prompts, interleaved sweeps, tables and plots.

Not part of the runtime: it reads the CPython stdlib for prompts and draws with matplotlib.
"""

from specdec.bench.corpus import held_out_prompts, stdlib_files
from specdec.bench.report import as_dict, markdown, plot
from specdec.bench.sweep import Config, Row, Tally, alpha_mle, configs, planned_gamma, run, summarize

__all__ = [
    "Config", "Row", "Tally", "alpha_mle", "as_dict", "configs", "held_out_prompts", "markdown",
    "planned_gamma", "plot", "run", "stdlib_files", "summarize",
]

"""Benchmarks of a bundle (``specdec bench``): held-out prompts, interleaved sweeps, tables and plots.

Not part of the runtime: it reads the CPython stdlib for prompts and draws with matplotlib.
"""

from specdec.commands.bench.corpus import CORPORA, code_prompts, held_out_prompts, prompts, stdlib_files
from specdec.commands.bench.report import as_dict, markdown, plot
from specdec.commands.bench.sweep import Config, Row, Tally, alpha_mle, configs, planned_gamma, run, summarize

__all__ = [
    "CORPORA", "Config", "Row", "Tally", "alpha_mle", "as_dict", "code_prompts", "configs", "held_out_prompts", "markdown",
    "planned_gamma", "plot", "prompts", "run", "stdlib_files", "summarize",
]

"""The commands, built on every layer: the ``specdec`` command line (``cli``), ``bench``,
``check``, ``distill`` and ``demo``.

Nothing below imports them: the foundation (``specdec/*.py``), ``export``, ``engines``,
``runtime`` and ``serve`` never reach up here (docs/architecture.md, Layers;
tests/test_layers.py fails when one does).
"""

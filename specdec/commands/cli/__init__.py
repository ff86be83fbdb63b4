"""The ``specdec`` command line, one module per command group; ``main`` (specdec/commands/cli/main.py)
holds the group and turns errors into exit statuses. Shared option parsing: ``options``.

Nothing is imported here, so a harness (``bench-serve`` reads ``serve``'s options) can import one
command's module without the whole group.
"""

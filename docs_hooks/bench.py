"""MkDocs hook: every measured figure in the docs is read from a results file under docs/bench/.

Prose never restates a number by hand; a page writes a placeholder and this hook expands it
while the site is built (``mkdocs.yml``: ``hooks: [docs_hooks/bench.py]``). Three forms, in
Python call syntax with literal arguments only (parsed with ``ast``, never evaluated):

    {{ bench("serve/results.json", "rows[mode=served γ=4,concurrency=1].tok_s", ".0f") }}
        one value: FILE (under docs/bench/), a PATH into its JSON, a format spec (default: str)

    {{ bench_table("batch/results.json", where={"temperature": 0},
                   columns={"clients": "{concurrency}", "tok/s": "{tok_s:.0f}"}) }}
        a Markdown table, one line per record of the list at ``rows`` (a PATH, default: the
        file's root); ``where`` keeps records whose fields match (a list value: any of them),
        ``has=("tokens_per_s",)`` keeps records that have those keys (a benchmark writes a
        row it could not run without them), ``best=("drafter", "speedup")`` keeps per drafter
        the record with the largest speedup;
        ``columns`` maps a header to a ``str.format`` template over the record

    {{ bench_include("threads.md") }}
        a benchmark's own Markdown report, inlined as written (a ``.txt`` report: as a text block)

    {{ bench_ratio("peers/results.json", "rows[peer=specdec].tok_s", "rows[peer=llamacpp].tok_s", ".2f") }}
        the first value over the second, both PATHs into the same file (a ratio measured in one run)

PATH: segments split on dots; a segment is a key, a list index, or a selector ``[k=v,k2=v2]``
taking the one record of a list whose fields match (numbers compare as numbers, so ``T=0``
matches 0.0). A trailing ``|min``, ``|max``, ``|median`` or ``|mean`` reduces a list of
numbers. A None renders as "–". A missing file or key, a selector matching no record or
several, or a placeholder that does not parse fails the build: a figure can go stale only
with its results file.
"""

from __future__ import annotations

import ast
import json
import re
import statistics
import string
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError


class BenchError(PluginError):
    """A placeholder names a results file, key or record that does not exist, or does not parse."""


NONE = "–"
REDUCERS = {"min": min, "max": max, "median": statistics.median, "mean": statistics.mean}
START = re.compile(r"\{\{\s*bench")
END = re.compile(r"\)\s*\}\}")
SEGMENT = re.compile(r"\[([^\]]*)\]|([^.\[\]]+)")
NUMERIC = re.compile(r"^[-+]?[\d.,]+\s*[×x%]?$|^–$")


def same(value: Any, wanted: Any) -> bool:
    """Loose equality for selectors: numbers as numbers, everything else as text."""
    try:
        return float(value) == float(wanted)
    except (TypeError, ValueError):
        return str(value) == str(wanted)


def matches(record: Any, where: dict) -> bool:
    if not isinstance(record, dict):
        return False
    for key, wanted in where.items():
        if key not in record:
            return False
        options = wanted if isinstance(wanted, (list, tuple)) else [wanted]
        if not any(same(record[key], w) for w in options):
            return False
    return True


def locate(records: Any, selector: str, where: str = "") -> int:
    """The index of the one record of ``records`` that a selector ``k=v,k2=v2`` matches."""
    clauses = dict(c.split("=", 1) for c in selector.split(",") if c.strip())
    clauses = {k.strip(): v.strip() for k, v in clauses.items()}
    if not isinstance(records, list):
        raise BenchError(f"{where}: selector [{selector}] applied to a {type(records).__name__}, not a list")
    found = [i for i, r in enumerate(records) if matches(r, clauses)]
    if len(found) != 1:
        raise BenchError(f"{where}: selector [{selector}] matches {len(found)} records, expected 1")
    return found[0]


def resolve(data: Any, path: str, where: str = "") -> Any:
    """The value at ``path`` in ``data`` (see the module docstring); raises BenchError naming the step."""
    path, _, reducer = path.partition("|")
    value = data
    for m in SEGMENT.finditer(path):
        selector, key = m.group(1), m.group(2)
        if selector is not None:
            value = value[locate(value, selector, where)]
        elif isinstance(value, dict):
            if key not in value:
                raise BenchError(f"{where}: no key {key!r} (have {sorted(value)[:12]})")
            value = value[key]
        elif isinstance(value, list) and key.isdigit():
            if int(key) >= len(value):
                raise BenchError(f"{where}: index {key} past the list's {len(value)} records")
            value = value[int(key)]
        else:
            raise BenchError(f"{where}: cannot take {key!r} of a {type(value).__name__}")
    if reducer:
        if reducer not in REDUCERS:
            raise BenchError(f"{where}: unknown reducer |{reducer}; expected one of {sorted(REDUCERS)}")
        value = REDUCERS[reducer](value)
    return value


def fmt(value: Any, spec: str) -> str:
    if value is None:
        return NONE
    return format(value, spec)


class RecordFormatter(string.Formatter):
    """``str.format`` whose fields are PATHs into one record, and which prints None as "–"."""

    def __init__(self, where: str):
        self.where = where

    def get_field(self, field_name, args, kwargs):
        return resolve(kwargs["record"], field_name, self.where), field_name

    def format_field(self, value, format_spec):
        # A value lands in a table cell: a "|" would split it, a "<model>" would vanish as HTML.
        return fmt(value, format_spec).replace("|", "\\|").replace("<", "&lt;")


class Bench:
    """Expands placeholders against the results files under one folder."""

    def __init__(self, root: Path, page: str = "?"):
        self.root, self.page = Path(root), page
        self.cache: dict[Path, Any] = {}

    def load(self, name: str) -> Any:
        path = self.root / name
        if not path.is_file():
            raise BenchError(f"{self.page}: no results file docs/bench/{name}")
        if path not in self.cache:
            self.cache[path] = json.loads(path.read_text()) if path.suffix == ".json" else path.read_text()
        return self.cache[path]

    def bench(self, name: str, path: str, spec: str = "") -> str:
        return fmt(resolve(self.load(name), path, f"{self.page}: docs/bench/{name} {path}"), spec)

    def bench_ratio(self, name: str, path: str, over: str, spec: str = "") -> str:
        where = f"{self.page}: docs/bench/{name}"
        a, b = resolve(self.load(name), path, where), resolve(self.load(name), over, where)
        if not (isinstance(a, (int, float)) and isinstance(b, (int, float)) and b):
            raise BenchError(f"{where}: bench_ratio needs two numbers, the second non-zero; got {a!r} / {b!r}")
        return fmt(a / b, spec)

    def bench_include(self, name: str) -> str:
        if name.endswith(".txt"):  # a tool's printed report, shown as printed
            return "```text\n" + self.load(name).strip() + "\n```"
        if not name.endswith(".md"):
            raise BenchError(f"{self.page}: bench_include takes a Markdown or text report, not {name}")
        lines, out = self.load(name).strip().splitlines(), []
        for line in lines:  # a table needs a blank line before it; reports often omit it
            if line.startswith("|") and out and out[-1].strip() and not out[-1].startswith("|"):
                out.append("")
            out.append(line)
        return "\n".join(out)

    def bench_table(self, name: str, columns: dict, rows: str = "", where: dict | None = None,
                    has: tuple = (), best: tuple | None = None) -> str:
        where_ = f"{self.page}: docs/bench/{name}"
        records = resolve(self.load(name), rows, where_) if rows else self.load(name)
        if not isinstance(records, list):
            raise BenchError(f"{where_} {rows!r}: expected a list of records, found a {type(records).__name__}")
        records = [r for r in records if matches(r, where or {}) and all(k in r for k in has)]
        if best:
            group, key = best
            chosen: dict = {}
            for r in records:
                g = resolve(r, group, where_)
                if resolve(r, key, where_) is not None and (g not in chosen or resolve(r, key, where_) > resolve(chosen[g], key, where_)):
                    chosen[g] = r
            records = list(chosen.values())
        if not records:
            raise BenchError(f"{where_}: no record matches where={where!r}")
        formatter = RecordFormatter(where_)
        cells = [[formatter.format(t, record=r) for t in columns.values()] for r in records]
        right = [all(NUMERIC.match(row[i].replace("*", "")) for row in cells) for i in range(len(columns))]
        lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---:" if r else "---" for r in right) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in cells]
        return "\n".join(lines)

    def call(self, source: str) -> str:
        """Evaluate one placeholder's call expression, literal arguments only."""
        tree = ast.parse(source.strip(), mode="eval").body
        if not (isinstance(tree, ast.Call) and isinstance(tree.func, ast.Name)
                and tree.func.id in ("bench", "bench_table", "bench_include", "bench_ratio")):
            raise BenchError(f"{self.page}: not a bench placeholder: {source.strip()[:80]}")
        try:
            args = [ast.literal_eval(a) for a in tree.args]
            kwargs = {k.arg: ast.literal_eval(k.value) for k in tree.keywords}
        except ValueError as e:
            raise BenchError(f"{self.page}: placeholder arguments must be literals: {source.strip()[:80]}") from e
        try:
            return getattr(self, tree.func.id)(*args, **kwargs)
        except (TypeError, KeyError, IndexError, ValueError) as e:
            raise BenchError(f"{self.page}: {source.strip()[:80]}: {e}") from e

    def expand(self, markdown: str) -> str:
        out, at = [], 0
        for start in START.finditer(markdown):
            if start.start() < at:
                continue
            for end in END.finditer(markdown, start.end()):
                source = markdown[start.start() + 2 : end.start() + 1]
                try:
                    ast.parse(source.strip(), mode="eval")
                except SyntaxError:
                    continue
                out += [markdown[at : start.start()], self.call(source)]
                at = end.end()
                break
            else:
                raise BenchError(f"{self.page}: unterminated placeholder: {markdown[start.start():start.start() + 80]!r}")
        out.append(markdown[at:])
        return "".join(out)


def expand(markdown: str, bench_dir: Path, page: str = "?") -> str:
    """Expand every placeholder in ``markdown`` against the results files under ``bench_dir``."""
    return Bench(bench_dir, page).expand(markdown)


def on_page_markdown(markdown, page, config, files):
    return expand(markdown, Path(config["docs_dir"]) / "bench", page.file.src_uri)

"""Every measured figure a user reads has a results file behind it.

A *figure* is a number with a unit of speed, time, size or ratio (``1.64×``, ``504 tok/s``,
``21.9 ms``, ``2.3%``, ``1.37 GB``) or an acceptance (``α 0.55``). Two ways to give one a source:

- pages under ``docs/`` write a placeholder that ``docs_hooks/bench.py`` renders at build time:
  ``{{ bench("peers/results.json", "rows[peer=llamacpp].tok_s", ".1f") }} tok/s``;
- README.md and the model cards, which GitHub and the hub show unrendered, write the figure
  followed by its source in a comment: ``1.64×<!-- bench_ratio("real-model/peers.json", ...) -->``.
  The figure must equal what its source renders.

Not figures: numbers in code (fenced or inline), in placeholders and comments, bounds
(``≥ 2.0×``, ``≤ 20 minutes``: goals and limits are not measurements), and a quantity its author
marks as not measured, with the reason, right after it: ``64 KiB<!-- not measured: a setting -->``
(a setting, a limit, a size computed from a shape).

``python docs_hooks/figures.py [FILE ...]`` prints every unsourced or stale figure and exits 1 on
any; with no FILE it checks README.md, docs/*.md and models/*/README.md.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the hook that renders placeholders; a sibling file, not a package)

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "docs" / "bench"

NUMBER = r"\d[\d,]*(?:\.\d+)?"
UNIT = r"(?:×|x(?![\w])|tok/s|tokens/s|ms\b|µs|s\b|%|[GMK]i?B\b|GB/s|minutes?\b|min\b|hours?\b|h\b)"
FIGURE = re.compile(
    rf"(?<![\w.≥≤<>])(?<![≥≤<>] )({NUMBER}(?:\s?[–-]\s?{NUMBER})?\s?{UNIT})"
    rf"|(?:\bα|\bacceptance(?: rate)?)\s*(?:=|of|is)?\s*(0\.\d+)"
)
NOT_MEASURED = re.compile(rf"{NUMBER}(?:\s?[–-]\s?{NUMBER})?(?:\s?{UNIT})?\**\s*<!--\s*not measured:[^>]*\w[^>]*-->")
SOURCED = re.compile(rf"({NUMBER})(\s?{UNIT})?(\**)\s*<!--\s*(bench\w*\(.*?\))\s*-->", re.S)
PLACEHOLDER = re.compile(r"\{\{\s*bench.*?\)\s*\}\}", re.S)
FENCED = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
COMMENT = re.compile(r"<!--.*?-->", re.S)
LINK_TARGET = re.compile(r"\]\([^)]*\)")


@dataclass(frozen=True)
class Finding:
    page: str
    line: int
    text: str
    why: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text!r}: {self.why}"


def blank(match: re.Match) -> str:
    """The match replaced by spaces, its newlines kept, so line numbers stay true."""
    return re.sub(r"[^\n]", " ", match.group(0))


def stale(text: str, bench_dir: Path, page: str) -> tuple[str, list[Finding]]:
    """Each ``FIGURE<!-- bench(...) -->`` checked against what its source renders; returns the
    text with those figures and comments blanked, and a finding for each that differs."""
    renderer, found = bench.Bench(bench_dir, page), []

    def check(m: re.Match) -> str:
        line = text.count("\n", 0, m.start()) + 1
        try:
            rendered = renderer.call(m.group(4))
        except bench.BenchError as e:
            found.append(Finding(page, line, m.group(0)[:80], f"its source fails: {e}"))
        else:
            if rendered != m.group(1):
                found.append(Finding(page, line, m.group(1), f"its source renders {rendered!r}"))
        return blank(m)

    return SOURCED.sub(check, text), found


def unsourced(text: str, page: str) -> list[Finding]:
    """Figures outside code, placeholders and comments: stated with no results file."""
    for pattern in (FENCED, PLACEHOLDER, NOT_MEASURED, COMMENT, INLINE_CODE, LINK_TARGET):
        text = pattern.sub(blank, text)
    return [
        Finding(page, text.count("\n", 0, m.start()) + 1, m.group(0), "no results file: a placeholder or a source comment")
        for m in FIGURE.finditer(text)
    ]


def check(text: str, page: str, bench_dir: Path = BENCH_DIR, rendered: bool = False) -> list[Finding]:
    """Every problem with the figures of one page. ``rendered``: the page is built by mkdocs, so
    placeholders are allowed; elsewhere a placeholder would reach the reader as written."""
    found = []
    if not rendered:
        for m in PLACEHOLDER.finditer(text):
            found.append(Finding(page, text.count("\n", 0, m.start()) + 1, m.group(0)[:60],
                                 "a placeholder on a page mkdocs does not render: write the figure and a source comment"))
    text, stale_found = stale(text, bench_dir, page)
    return found + stale_found + unsourced(text, page)


def pages(root: Path = ROOT) -> list[tuple[Path, bool]]:
    """(page, rendered by mkdocs) for every page a user reads; benchmark reports under
    docs/bench are results files themselves."""
    docs = sorted((root / "docs").glob("*.md")) + sorted((root / "docs" / "archive").glob("*.md"))
    return [(root / "README.md", False)] + [(p, True) for p in docs] + [
        (p, False) for p in sorted((root / "models").glob("*/README.md"))]


def main(argv: list[str]) -> int:
    chosen = [(Path(a).resolve(), Path(a).resolve().is_relative_to(ROOT / "docs")) for a in argv] or pages()
    findings = [f for path, rendered in chosen
                for f in check(path.read_text(), str(path.relative_to(ROOT)), rendered=rendered)]
    for f in findings:
        print(f)
    print(f"{len(findings)} unsourced or stale figures in {len(chosen)} pages", file=sys.stderr)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The documentation builds, links resolve, and every measured figure comes from a results file.

The site is built with ``mkdocs build --strict`` (a broken link, a missing anchor or a
placeholder naming a missing results file or key fails it); ``docs_hooks/figures.py`` finds a
figure stated with no results file, or differing from its file, on any page a user reads; the
README stays a front page and the docs stay readable in size.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200
DOCS_MAX_LINES = 4500  # docs/*.md and docs/archive/*.md; benchmark reports under docs/bench are results files


def load_hook(name: str = "bench"):
    spec = importlib.util.spec_from_file_location(f"specdec_docs_{name}_hook", ROOT / "docs_hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_mkdocs_strict_build(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stderr}\n{run.stdout}"


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; keep it <= {README_MAX_LINES} and move detail to docs/"


def test_docs_stay_readable_in_size():
    pages = sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "docs" / "archive").glob("*.md"))
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in pages}
    assert sum(lines.values()) <= DOCS_MAX_LINES, (
        f"the docs have {sum(lines.values())} lines; keep them <= {DOCS_MAX_LINES} (largest: "
        f"{sorted(lines.items(), key=lambda kv: -kv[1])[:4]}): move history out, or delete it")


def test_readme_relative_links_exist():
    text = (ROOT / "README.md").read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # links inside code blocks are not links
    targets = re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text)
    assert targets, "README.md links to no docs page"
    missing = []
    for target in targets:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http(s):, mailto:, in-page anchors
        path = target.split("#", 1)[0]
        if not (ROOT / path).exists():
            missing.append(target)
    assert not missing, f"README.md links to missing files: {missing}"


@pytest.fixture
def bench_dir(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "results.json").write_text(json.dumps({
        "rows": [
            {"mode": "plain", "T": 0.0, "tok_s": 500.25, "ratio": [0.9, 1.0, 1.1], "alpha": None},
            {"mode": "spec", "T": 0.0, "tok_s": 812.5, "ratio": [1.2, 1.4, 1.6], "alpha": 0.75},
            {"mode": "spec", "T": 1.0, "tok_s": 640.0, "ratio": [1.0, 1.1, 1.2], "alpha": 0.7},
        ],
    }))
    return tmp_path


def test_hook_renders_values_and_tables(bench_dir):
    hook = load_hook()
    page = hook.expand(
        'a {{ bench("run/results.json", "rows[mode=spec,T=0].tok_s", ".0f") }} b '
        '{{ bench("run/results.json", "rows.1.ratio|median", ".2f") }}\n\n'
        '{{ bench_table("run/results.json", rows="rows", where={"T": 0},\n'
        '   columns={"mode": "{mode}", "tok/s": "{tok_s:.1f}", "α": "{alpha:.2f}"}) }}',
        bench_dir,
    )
    assert page.startswith("a 812 b 1.40\n\n")
    assert "| mode | tok/s | α |" in page
    assert "| plain | 500.2 | – |" in page  # None renders as a dash
    assert "| spec | 812.5 | 0.75 |" in page
    assert "640.0" not in page  # filtered out by where
    ratio = hook.expand('{{ bench_ratio("run/results.json", "rows[mode=spec,T=0].tok_s", "rows[mode=plain].tok_s", ".3f") }}', bench_dir)
    assert ratio == f"{812.5 / 500.25:.3f}"


@pytest.mark.parametrize("placeholder, complaint", [
    ('{{ bench("missing/results.json", "rows.0.tok_s") }}', "no results file"),
    ('{{ bench("run/results.json", "rows.0.no_such_key") }}', "no key"),
    ('{{ bench("run/results.json", "rows[mode=nothing].tok_s") }}', "matches 0 records"),
    ('{{ bench("run/results.json", "rows[mode=spec].tok_s") }}', "matches 2 records"),
    ('{{ bench("run/results.json", "rows.9.tok_s") }}', "index 9"),
    ('{{ bench_table("run/results.json", rows="rows", columns={"x": "{nope}"}) }}', "no key"),
    ('{{ bench_table("run/results.json", rows="rows", where={"T": 5}, columns={"x": "{mode}"}) }}', "no record"),
    ('{{ bench("run/results.json", __import__("os").getcwd()) }}', "literals"),
    ('{{ bench_ratio("run/results.json", "rows[mode=plain].tok_s", "rows[mode=plain].alpha") }}', "two numbers"),
])
def test_hook_fails_the_build_on_a_missing_file_or_key(bench_dir, placeholder, complaint):
    hook = load_hook()
    with pytest.raises(hook.BenchError, match=re.escape(complaint)):
        hook.expand(f"text {placeholder} text", bench_dir)


def test_every_placeholder_in_the_docs_resolves():
    """The same check the build makes, without mkdocs' other machinery: a clearer failure."""
    hook = load_hook()
    for page in sorted((ROOT / "docs").rglob("*.md")):
        hook.expand(page.read_text(), ROOT / "docs" / "bench", str(page.relative_to(ROOT)))


def test_families_table_covers_every_supported_architecture(tmp_path):
    """docs/families.md's table (written by tools/families_table.py from a test run) has a row
    for every model type the export takes, each cell a mark the tool writes; and the tool turns
    a junit report into those marks (a passed, a failed and a skipped test)."""
    sys.path.insert(0, str(ROOT / "tools"))
    import families_table

    from specdec.export.families import SUPPORTED

    text = (ROOT / "docs" / "families.md").read_text()
    body = text.split(families_table.BEGIN, 1)[1].split(families_table.END, 1)[0]
    rows = [ln.strip("|").split("|") for ln in body.strip().splitlines() if ln.startswith("|")][2:]
    assert sorted(r[0].strip() for r in rows) == sorted(SUPPORTED) == sorted(families_table.FAMILIES.values())
    marks = {m for r in rows for c in r[1:] for m in c.strip().split(" · ")}
    assert all(len(r) == len(families_table.COLUMNS) + 1 for r in rows) and marks <= {"✓", "✗", "—"}, rows
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.runtime.test_decoder_exact" name="test_greedy_matches_target_for_every_family[gemma2]"/>'
        '<testcase classname="tests.runtime.test_batch" name="test_batched_greedy_matches_target_per_row[gemma2-lookup]"><failure/></testcase>'
        '<testcase classname="tests.export.test_gguf" name="test_new_family_gguf_decodes_as_pytorch[gemma2]"><skipped/></testcase>'
        '<testcase classname="tests.export.test_gguf" name="test_gguf_bundle_decodes_as_pytorch@test_gguf"/>'  # a loadgroup test's name
        "</testsuite></testsuites>"
    )
    cells = families_table.outcomes(junit)
    assert cells == {("greedy = PyTorch", "gemma2"): [True], ("batched (BatchEngine)", "gemma2"): [False], ("GGUF in", "llama"): [True]}
    table = families_table.table({"4.57": cells})
    assert "| gemma2 | ✓ | — | — | ✗ | — | — | — | — |" in table
    both = families_table.table({"4.57": cells, "5.24": {("greedy = PyTorch", "gemma2"): [False]}})  # one mark per run, in order
    assert "Each cell: transformers 4.57 · 5.24." in both and "| gemma2 | ✓ · ✗ | — · — | — · — | ✗ · — |" in both


def test_every_figure_a_user_reads_has_its_results_file():
    """README.md, docs/ (with the archive) and the model cards: no figure without a source, none
    differing from what its source renders."""
    figures = load_hook("figures")
    found = [str(f) for path, rendered in figures.pages()
             for f in figures.check(path.read_text(), str(path.relative_to(ROOT)), rendered=rendered)]
    assert not found, "figures with no results file, or stale:\n" + "\n".join(found[:40])


def mutate(bench, data, path: str):
    """``data`` with the number at a bench PATH (no reducer) increased by 1: a result that changed."""
    parent, key = None, None
    for m in bench.SEGMENT.finditer(path):
        parent = data if parent is None else parent[key]
        selector, name = m.group(1), m.group(2)
        key = bench.locate(parent, selector) if selector is not None else int(name) if isinstance(parent, list) else name
    parent[key] = parent[key] + 1
    return data


def test_a_changed_result_or_an_unsourced_number_is_caught(tmp_path):
    """Mutation check on the real pages: each README figure sourced by ``bench`` goes stale when
    its number changes in a copy of its results file (the first against a copy of every results
    file, as the page is checked); a number typed into a page, or a source comment's figure
    edited, is reported."""
    figures = load_hook("figures")
    readme = (ROOT / "README.md").read_text()
    sourced = [m for m in figures.SOURCED.finditer(readme) if m.group(4).startswith("bench(") and "|" not in m.group(4)]
    assert len(sourced) >= 5, "the README should cite its figures' results files"
    for i, m in enumerate(sourced):
        name, path, *_ = ast.literal_eval(m.group(4)[len("bench"):])
        bench_copy = tmp_path / str(i)
        if i == 0:  # the whole folder once: the README checked as a page, every other source found
            shutil.copytree(ROOT / "docs" / "bench", bench_copy, ignore=shutil.ignore_patterns("*.png"))
        else:  # the rest: each figure against its own mutated file
            (bench_copy / name).parent.mkdir(parents=True)
            shutil.copy(ROOT / "docs" / "bench" / name, bench_copy / name)
        (bench_copy / name).write_text(json.dumps(mutate(figures.bench, json.loads((bench_copy / name).read_text()), path)))
        found = figures.check(readme, "README.md", bench_dir=bench_copy) if i == 0 else figures.stale(m.group(0), bench_copy, "README.md")[1]
        assert [f for f in found if f.text == m.group(1) and "renders" in f.why], (m.group(0)[:120], found)
    page = (ROOT / "docs" / "glossary.md").read_text()
    assert not figures.check(page, "docs/glossary.md", rendered=True)
    typed = page.replace("\n\n", "\n\nOn this box it ran 3.7× faster, at 41.5 tok/s.\n\n", 1)
    assert [f.text for f in figures.check(typed, "docs/glossary.md", rendered=True)] == ["3.7×", "41.5 tok/s"]
    edited = readme.replace(sourced[0].group(0), sourced[0].group(0).replace(sourced[0].group(1), "9" + sourced[0].group(1), 1), 1)
    assert [f.why for f in figures.check(edited, "README.md")][0].startswith("its source renders")

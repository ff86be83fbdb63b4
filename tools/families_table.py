"""docs/families.md's table of families x features, filled from test runs (never by hand).

    python -m pytest tests --junitxml=.bench/junit-5.24.xml                       # one run per transformers version
    tools/test_stacks.sh tests --junitxml=.bench/junit-4.57.xml                   # the same on transformers 4.57, in its own venv
    python tools/families_table.py 4.57=.bench/junit-4.57.xml 5.24=.bench/junit-5.24.xml   # rewrites the table in docs/families.md

A mark is ✓ when at least one of the column's tests ran for that family and every one that ran
passed, ✗ when one failed, and — when none ran (no test yet: the feature is not claimed). With
several runs (``LABEL=FILE``, e.g. one per transformers version) a cell holds one mark per run,
in the order given and named in the line above the table. The family of a test is its
parameter (``[gemma2-lookup]``) or, for a test written for one family, the family given here.
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "families.md"
BEGIN, END = "<!-- families table: tools/families_table.py -->", "<!-- end of families table -->"

# test family name -> what users know it by (transformers model_type)
FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma3": "gemma3_text", "gemma2": "gemma2",
            "mistral": "mistral", "gpt2": "gpt2", "opt": "opt", "gpt_neox": "gpt_neox", "t5": "t5", "bart": "bart",
            "marian": "marian", "mt5": "mt5", "umt5": "umt5", "mbart": "mbart", "pegasus": "pegasus"}  # fmt: skip

# column -> (test file::function, the family when the test is not parametrized by one)
COLUMNS = {
    "greedy = PyTorch": [("runtime/test_decoder_exact.py::test_greedy_matches_target_for_every_family", None),
                         ("runtime/test_seq2seq.py::test_greedy_matches_pytorch", None),
                         ("export/test_seq2seq_families.py::test_family_decodes_as_transformers", None)],
    "sampled in law (χ²)": [("runtime/test_decoder_exact.py::test_first_two_tokens_follow_the_target_in_new_families", None),
                            ("runtime/test_decoder_exact.py::test_first_two_tokens_follow_the_target", None),
                            ("runtime/test_seq2seq.py::test_first_two_tokens_follow_the_target", None)],
    "every drafter": [("runtime/test_drafters.py::test_greedy_matches_target_with_every_drafter", None)],
    "batched (BatchEngine)": [("runtime/test_batch.py::test_batched_greedy_matches_target_per_row", None),
                              ("runtime/test_seq2seq.py::test_batch_engine_serves_encoder_decoder_bundles", None)],
    "int8 / int4": [("export/test_export.py::test_quantized_bundle", "llama"),
                    ("export/test_export.py::test_new_families_quantize_and_decode_exactly", None),
                    ("export/test_seq2seq_export.py::test_quantized_and_half_bundles_decode_as_their_own_target", "t5")],
    "GGUF in": [("export/test_gguf.py::test_gguf_bundle_decodes_as_pytorch", "llama"),
                ("export/test_gguf.py::test_new_family_gguf_decodes_as_pytorch", None)],
    "TensorRT-ready graphs": [("export/test_export.py::test_portable_flavour_is_standard_ops_and_exact", None)],
    "feature drafter": [("runtime/test_feature_drafter.py::test_feature_drafter_greedy_is_the_target_token_for_token", None),
                        ("runtime/test_feature_drafter.py::test_feature_drafter_first_two_tokens_follow_the_target", None),
                        ("runtime/test_feature_drafter.py::test_feature_drafter_in_a_batch_keeps_each_row_exact", None)],
    "specdec check": [("check/test_check.py::test_every_family_passes_the_quick_check", None),
                      ("check/test_check.py::test_encoder_decoder_bundles_get_the_greedy_check", None)],
}


def _family(params: str, given: str | None) -> str | None:
    if given is not None:
        return given
    return next((part for part in re.split(r"[-\[\]]", params) if part in FAMILIES), None)


def outcomes(junit: Path) -> dict[tuple[str, str], list[bool]]:
    """(column, family) -> pass/fail of each of the column's tests that ran for the family."""
    cells: dict[tuple[str, str], list[bool]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.find("skipped") is not None:
            continue
        path = case.get("classname", "").replace(".", "/")  # tests.runtime.test_batch -> tests/runtime/test_batch
        name = case.get("name", "").split("@", 1)[0]  # pytest-xdist's --dist loadgroup appends @GROUP
        func, _, params = name.partition("[")
        node = f"{path.removeprefix('tests/')}.py::{func}"
        ok = case.find("failure") is None and case.find("error") is None
        for column, tests in COLUMNS.items():
            for test, given in tests:
                fam = _family("[" + params, given) if node == test else None
                if fam is not None:
                    cells.setdefault((column, fam), []).append(ok)
    return cells


def mark(ran: list[bool]) -> str:
    return "—" if not ran else ("✓" if all(ran) else "✗")


def table(runs: dict[str, dict[tuple[str, str], list[bool]]]) -> str:
    """One row per family, one column per feature; a cell has one mark per run (``runs``' order)."""
    rows = [f"Each cell: transformers {' · '.join(runs)}." if len(runs) > 1 else "", "",
            "| family (model_type) | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]  # fmt: skip
    for fam, model_type in FAMILIES.items():
        cells = [" · ".join(mark(cells.get((column, fam), [])) for cells in runs.values()) for column in COLUMNS]
        rows.append(f"| {model_type} | " + " | ".join(cells) + " |")
    return "\n".join(rows[2:] if len(runs) == 1 else rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("junit", nargs="+", help="pytest --junitxml output of a full run, as FILE or LABEL=FILE (LABEL: what differs, e.g. 5.24)")
    args = ap.parse_args(argv)
    runs = {}
    for given in args.junit:
        label, _, file = given.rpartition("=")
        runs[label or file] = outcomes(Path(file))
        if not runs[label or file]:
            print(f"{file}: no family tests ran; pass the junit file of a full run", file=sys.stderr)
            return 2
    text = DOC.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{BEGIN}\n{table(runs)}\n{END}{tail}")
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

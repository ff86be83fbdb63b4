"""The installed ``specdec`` console script, run as a user would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.runtime.analysis import plan

def console_script(name: str) -> str | None:
    """The ``name`` script installed beside this interpreter (None: run ``python -m`` instead).
    Not PATH's first: in a venv over system packages (tools/test_stacks.sh) that one would
    run another interpreter, with another transformers."""
    script = Path(sys.executable).with_name(name)
    return str(script) if script.is_file() else None


SPECDEC = console_script("specdec")


def run(*args: str) -> subprocess.CompletedProcess:
    cmd = [SPECDEC, *args] if SPECDEC else [sys.executable, "-m", "specdec", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_plan_json_picks_optimal_gamma():
    out = run("plan", "--alpha", "0.8", "--cost", "0.05", "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert set(got) == {"gamma", "expected_tokens", "speedup", "operations"}
    assert got == plan(0.8, 0.05)._asdict()


def test_plan_json_with_gamma_and_cost_ops():
    out = run("plan", "--alpha", "0.7", "--cost", "0.02", "--cost-ops", "0.1", "--gamma", "3", "--json")
    got = json.loads(out.stdout)
    assert got["gamma"] == 3
    assert got["operations"] == pytest.approx(plan(0.7, 0.02, 0.1, 3).operations)


def test_plan_table_marks_the_choice():
    out = run("plan", "--alpha", "0.8", "--cost", "0.05")
    assert out.returncode == 0
    chosen = plan(0.8, 0.05).gamma
    marked = [line for line in out.stdout.splitlines() if "chosen" in line]
    assert len(marked) == 1 and marked[0].split()[0] == str(chosen)


@pytest.mark.parametrize(
    "args, word",
    [
        (["--alpha", "1.5", "--cost", "0.1"], "alpha"),
        (["--alpha", "0", "--cost", "0.1"], "alpha"),
        (["--alpha", "0.5", "--cost", "-1"], "cost"),
        (["--alpha", "0.5", "--cost", "0.1", "--gamma", "0"], "gamma"),
        (["--alpha", "0.5", "--cost", "x"], "--cost"),
        (["--cost", "0.1"], "--alpha"),
        (["--batch", "0.9,x", "--cost", "0.1"], "--batch"),
        (["--batch", "0.9,1.2", "--cost", "0.1"], "alpha"),
    ],
)
def test_plan_bad_values_exit_2_with_one_line(args, word):
    out = run("plan", *args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and word in lines[0], out.stderr
    assert "Traceback" not in out.stderr


def test_plan_batch_is_the_sum_of_its_rows_theorem():
    """--batch: a call verifying γ for every row yields Σ_r E[tokens](α_r, γ) in γc + v plain steps;
    one predictable row among unpredictable ones is worth a small γ only, and a batch of
    unpredictable rows decodes plainly, where one row alone at the same α would not."""
    from specdec.runtime.analysis import expected_tokens

    got = json.loads(run("plan", "--batch", "0.9,0.2,0.2,0.2", "--cost", "0.1", "--verify-cost", "1.4", "--json").stdout)
    want = {g: sum(expected_tokens(a, g) for a in (0.9, 0.2, 0.2, 0.2)) / (4 * (0.1 * g + 1.4)) for g in range(1, 17)}
    want[0] = 1.0
    assert got["gamma"] == max(want, key=want.get) and all(abs(got["speedups"][str(g)] - x) < 1e-12 for g, x in want.items())
    plain = json.loads(run("plan", "--batch", "0.3,0.3,0.3", "--cost", "0.1", "--verify-cost", "1.4", "--json").stdout)
    alone = json.loads(run("plan", "--alpha", "0.3", "--cost", "0.1", "--json").stdout)  # v = 1: one row, a memory-bound call
    assert plain["gamma"] == 0 and alone["gamma"] > 0


def test_plan_trees_from_a_measured_cost_curve(tmp_path):
    from specdec.runtime.analysis import plan_trees

    curve = tmp_path / "cost.json"
    rows = [{"graph": "plain, 1 token", "nodes": 1, "vs_one_token": 1.0}] + [
        {"graph": f"tree, {n} nodes", "nodes": n, "vs_one_token": v} for n, v in ((1, 1.0), (4, 1.05), (8, 1.1), (16, 1.2))]
    curve.write_text(json.dumps({"rows": rows}))
    out = run("plan", "--cost", "0.05", "--rank-acceptance", "0.7,0.15,0.05", "--tree-cost", str(curve), "--json")
    assert out.returncode == 0, out.stderr
    want = plan_trees([0.7, 0.15, 0.05], 0.05, {1: 1.0, 4: 1.05, 8: 1.1, 16: 1.2}, 16)
    assert json.loads(out.stdout)[0] == want[0]._asdict()
    table = run("plan", "--cost", "0.05", "--rank-acceptance", "0.7,0.15,0.05", "--tree-cost", str(curve))
    assert f"--tree-nodes {want[0].nodes}" in table.stdout and f"--gamma {want[0].depth}" in table.stdout
    for args, word in ((["--rank-acceptance", "0.7,x", "--tree-cost", str(curve)], "--rank-acceptance"),
                       (["--rank-acceptance", "0.7,0.5", "--tree-cost", str(curve)], "rank_acceptance"),
                       (["--rank-acceptance", "0.7"], "--tree-cost")):
        bad = run("plan", "--cost", "0.05", *args)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and word in bad.stderr, bad.stderr


def test_runtime_imports_without_torch():
    """Production services import the runtime with NumPy and ONNX Runtime only."""
    code = "import sys, specdec.runtime, specdec.engines; bad = {'torch', 'transformers', 'onnx', 'optimum'} & set(sys.modules); print(sorted(bad))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

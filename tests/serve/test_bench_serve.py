"""``specdec bench-serve``: real servers on loopback ports, the chat bundle, tiny loads."""

from __future__ import annotations

import json
import subprocess
import sys

from test_cli import SPECDEC  # noqa: E402


def bench(*args: str) -> subprocess.CompletedProcess:
    cmd = [SPECDEC, "bench-serve", *args] if SPECDEC else [sys.executable, "-m", "specdec", "bench-serve", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def check(out, got: subprocess.CompletedProcess, servers: list[str]) -> list[dict]:
    """Exit 0, a row per (server, concurrency) with tokens and no errors, provenance and the plot."""
    assert got.returncode == 0, got.stderr
    data = json.loads((out / "results.json").read_text())
    rows = data["rows"]
    assert sorted((r["mode"], r["concurrency"]) for r in rows) == sorted((s, c) for s in servers for c in (1, 2))
    assert all(r["tok_s"] > 0 and r["errors"] == 0 and r["requests"] > 0 for r in rows), rows
    # the CPU each run took: the client's (this benchmark's process) and the server's, which decoded every token
    assert all(0 < r["client_cores"] and 0 < r["server_cores"] and r["server_cpu_ms_per_token"] > 0 for r in rows), rows
    assert "| client cores |" in (out / "results.md").read_text()
    assert "bench-serve" in data["provenance"]["command"]
    assert (out / "load.png").is_file() and "Regenerate:" in (out / "results.md").read_text()
    return rows


def test_servers_side_by_side(chat_bundle, tmp_path):
    got = bench(str(chat_bundle[1]), "--server", "γ=4=--gamma 4", "--server", "plain=--gamma 0", "--concurrency", "1,2", "--requests", "3",
                "--prompt-tokens", "8", "--tokens", "8", "--no-overhead", "--out", str(tmp_path))  # fmt: skip
    rows = check(tmp_path, got, ["γ=4", "plain"])
    assert [r["mode"] for r in rows] == ["γ=4", "plain", "plain", "γ=4"]  # interleaved, the order alternating
    assert "| γ=4 |" in got.stdout
    # greedy: every reply equal token for token across servers; tok/s over the plain server's in the same round
    assert all(r["same_outputs"] for r in rows) and all(r["vs_plain"] == 1.0 for r in rows if r["mode"] == "plain")
    by = {(r["mode"], r["concurrency"]): r["tok_s"] for r in rows}
    assert all(abs(r["vs_plain"] - by[(r["mode"], r["concurrency"])] / by[("plain", r["concurrency"])]) < 1e-12 for r in rows)
    assert "| tok/s / plain | outputs equal |" in got.stdout


def test_multi_turn_chat_with_and_without_prefix_reuse(chat_bundle, tmp_path):
    got = bench(str(chat_bundle[1]), "--server", "reuse=", "--server", "no reuse=--no-prefix-reuse", "--turns", "2", "--chat",
                "--concurrency", "1,2", "--requests", "2", "--prompt-tokens", "8", "--tokens", "8", "--no-overhead", "--out", str(tmp_path))  # fmt: skip
    rows = check(tmp_path, got, ["reuse", "no reuse"])
    for r in rows:
        assert len(r["turn_ttft_ms"]) == 2 and all(t > 0 for t in r["turn_ttft_ms"])
        assert (r["prefix_hit_rate"] > 0) == (r["mode"] == "reuse"), r  # the second turn keeps the first's prefix
    assert "TTFT turn 1 ms" in got.stdout


def test_malformed_server_exits_2_with_one_line(tmp_path):
    for spec, word in (("plain", "NAME=ARGS"), ("x=--no-such-option", "--no-such-option"), ("x=--port 9", "--port")):
        got = bench(str(tmp_path), "--server", spec)
        lines = got.stderr.strip().splitlines()
        assert got.returncode == 2 and len(lines) == 1 and word in lines[0], got.stderr


def test_isolation_trials_show_the_side_channel_only_without_isolation(chat_bundle, tmp_path):
    """--isolation: through the official client, the other tenant's request gets no prefix hit
    from an isolating server and every token of it from a shared one; the same tenant's gets its own."""
    got = bench(str(chat_bundle[1]), "--isolation", "2", "--prompt-tokens", "60", "--out", str(tmp_path))
    assert got.returncode == 0, got.stderr
    rows = {(r["server"], r["kind"]): r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    assert rows[("isolated", "other")]["hits"] == 0 and rows[("shared", "other")]["hits"] == 2 * 59
    assert rows[("isolated", "same")]["hits"] == rows[("shared", "same")]["hits"] == 2 * 59 and rows[("isolated", "cold")]["hits"] == 0
    assert all(r["ttft_ms_p50"] > 0 and r["trials"] == 2 for r in rows.values())

"""The suite's time budget, reported on every run (docs/contributing.md).

Every run ends with the suite's wall time, the 10 slowest tests (setup + call + teardown; a
module fixture's export counts in the first test that asks for it) and the 10 slowest fixtures
(each xdist worker's share of the shared exports as ``prebuild ...``, tests/bundles.py), and a
line for each test over the per-test budget. ``--timing-json PATH`` writes every
test's and fixture's seconds, and the total per file, for tools that track the budget.

The budget is reported, not enforced by default: a slower box (CI's runs ~2.5x this one) must not
turn a timing into a red run. ``--enforce-budget`` fails the session when a test or the whole
suite is over, for a run on the reference box.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import pytest

SUITE_BUDGET_S = 20 * 60  # the whole suite, on the reference box (2 cores)
TEST_BUDGET_S = 60.0  # one test, setup and teardown included


def pytest_addoption(parser):
    group = parser.getgroup("specdec timing")
    group.addoption("--timing-json", metavar="PATH", help="write each test's and fixture's seconds here")
    group.addoption("--enforce-budget", action="store_true", help="fail the run when a test or the suite is over budget")


class FixtureClock:
    """In the process that runs the tests (an xdist worker, or the only one): each fixture's
    setup seconds, attached to the setup report of the test that paid for them, so that the
    process that reports sees them whether or not tests run in workers."""

    def __init__(self):
        self.pending: list[tuple[str, float]] = []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        t0 = time.perf_counter()
        yield
        param = getattr(request, "param", None)
        label = "" if param is None else f"[{str(param)[:40]}]"
        self.pending.append((f"{fixturedef.argname}{label} ({fixturedef.scope})", time.perf_counter() - t0))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        if call.when == "setup":
            outcome.get_result().user_properties.append(("fixture_setup_s", self.pending))
            self.pending = []


class Timing:
    def __init__(self, config):
        self.config = config
        self.start = time.perf_counter()
        self.tests: dict[str, float] = defaultdict(float)  # nodeid -> setup + call + teardown
        self.fixtures: dict[str, float] = defaultdict(float)  # "name[param] (scope)" -> setup seconds

    def pytest_runtest_logreport(self, report):
        self.tests[report.nodeid] += report.duration
        for key, value in report.user_properties:
            if key == "fixture_setup_s":
                for name, s in value:
                    self.fixtures[name] += s

    def over(self) -> tuple[float, list[tuple[str, float]]]:
        total = time.perf_counter() - self.start
        return total, [(n, s) for n, s in self.tests.items() if s > TEST_BUDGET_S]

    def pytest_terminal_summary(self, terminalreporter):
        if not self.tests:
            return
        tr = terminalreporter
        total, slow = self.over()
        per_file: dict[str, float] = defaultdict(float)
        for nodeid, s in self.tests.items():
            per_file[nodeid.split("::")[0]] += s
        tr.section("time budget")
        tr.write_line(f"suite: {total:.0f} s of {SUITE_BUDGET_S} s; {len(self.tests)} tests")
        tr.write_line("slowest tests (setup + call + teardown; a session fixture counts once, in its first user):")
        for nodeid, s in sorted(self.tests.items(), key=lambda kv: -kv[1])[:10]:
            tr.write_line(f"  {s:7.1f} s  {short(nodeid)}")
        tr.write_line("slowest fixtures (setup):")
        for key, s in sorted(self.fixtures.items(), key=lambda kv: -kv[1])[:10]:
            tr.write_line(f"  {s:7.1f} s  {key}")
        for nodeid, s in slow:
            tr.write_line(f"OVER BUDGET: {short(nodeid)} took {s:.1f} s (a test's budget is {TEST_BUDGET_S:.0f} s)", red=True)
        if total > SUITE_BUDGET_S:
            tr.write_line(f"OVER BUDGET: the suite took {total:.0f} s (budget {SUITE_BUDGET_S} s)", red=True)
        path = self.config.getoption("--timing-json")
        if path:
            Path(path).write_text(json.dumps({
                "total_s": round(total, 2),
                "tests": {k: round(v, 3) for k, v in sorted(self.tests.items(), key=lambda kv: -kv[1])},
                "fixtures": {k: round(v, 3) for k, v in sorted(self.fixtures.items(), key=lambda kv: -kv[1])},
                "files": {k: round(v, 2) for k, v in sorted(per_file.items(), key=lambda kv: -kv[1])},
            }, indent=1))  # fmt: skip

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        if not self.config.getoption("--enforce-budget"):
            return
        total, slow = self.over()
        if (slow or total > SUITE_BUDGET_S) and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def short(nodeid: str, width: int = 160) -> str:
    return nodeid if len(nodeid) <= width else nodeid[: width - 3] + "..."


def pytest_configure(config):
    config.pluginmanager.register(FixtureClock(), "specdec-fixture-clock")
    if getattr(config, "workerinput", None) is None:  # the controller only under xdist: workers report to it
        config.pluginmanager.register(Timing(config), "specdec-timing")

"""Where the suite's time goes: the seconds of each test file (setup, call and teardown of its tests, module
fixtures included), printed at the end of a run, slowest first, with the share of the whole. `make test` must stay
well inside CI's limit: this shows which file to look at when it grows."""

from __future__ import annotations

from collections import defaultdict

import pytest

_per_file: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _per_file[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    total = sum(_per_file.values())
    if total < 60:  # a targeted run: nothing to learn
        return
    tr = terminalreporter
    tr.section("time per test file")
    for path, s in sorted(_per_file.items(), key=lambda kv: -kv[1])[:15]:
        tr.write_line(f"{s:8.1f}s {100 * s / total:5.1f}%  {path}")
    tr.write_line(f"{total:8.1f}s in all (tests, fixtures included; collection not counted)")

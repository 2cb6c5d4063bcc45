"""pytest plugin: a JUnit XML file rewritten after every test, so a run stopped by a timeout still leaves one.

pytest's own --junitxml is written at the end of the session only; when loadtest/gpu_check.sh stops a step
at its limit (with pytest-xdist workers busy) that end never comes. This file holds every test finished so
far; the suite's `incomplete` property says whether the session ended.

    python -m pytest -p loadtest.junit_live --junit-live results/kernel_tests.xml tests/...
"""

from __future__ import annotations

import os
import time
from xml.sax.saxutils import escape, quoteattr


def pytest_addoption(parser) -> None:
    parser.addoption("--junit-live", default=None, metavar="PATH",
                     help="write a JUnit XML file after every test (complete or not)")


class LiveJUnit:
    def __init__(self, path: str):
        self.path, self.t0 = path, time.time()
        self.cases: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report) -> None:
        case = self.cases.setdefault(report.nodeid, {"outcome": "passed", "time": 0.0, "message": ""})
        case["time"] += report.duration
        if report.failed:
            case["outcome"] = "failure" if report.when == "call" else "error"
            case["message"] = report.longreprtext[-4000:]
        elif report.skipped and case["outcome"] == "passed":
            case["outcome"] = "skipped"
            case["message"] = str(report.longrepr)[-500:]
        if report.when == "teardown":
            self.write(done=False)

    def pytest_sessionfinish(self) -> None:
        self.write(done=True)

    def write(self, done: bool) -> None:
        counts = {k: sum(c["outcome"] == k for c in self.cases.values()) for k in ("failure", "error", "skipped")}
        lines = ['<?xml version="1.0" encoding="utf-8"?>', "<testsuites>",
                 f'<testsuite name="pytest" tests="{len(self.cases)}" failures="{counts["failure"]}" '
                 f'errors="{counts["error"]}" skipped="{counts["skipped"]}" time="{time.time() - self.t0:.1f}">',
                 f'<properties><property name="incomplete" value="{str(not done).lower()}"/></properties>']
        for nodeid, c in self.cases.items():
            cls, _, name = nodeid.rpartition("::")
            lines.append(f'<testcase classname={quoteattr(cls)} name={quoteattr(name)} time="{c["time"]:.3f}">')
            if c["outcome"] != "passed":
                tag = c["outcome"]
                lines.append(f"<{tag} message={quoteattr(c['message'][:200])}>{escape(c['message'])}</{tag}>")
            lines.append("</testcase>")
        lines += ["</testsuite>", "</testsuites>"]
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            f.write("\n".join(lines))
        os.replace(tmp, self.path)


def pytest_configure(config) -> None:
    path = config.getoption("--junit-live")
    if path and not hasattr(config, "workerinput"):  # the controller only (pytest-xdist workers report to it)
        config.pluginmanager.register(LiveJUnit(path), "junit_live_writer")

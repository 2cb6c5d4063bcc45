"""The pure parts of the chaos campaign (loadtest/chaos/): trend test, verdicts, metric parsing, report."""

from __future__ import annotations

import pytest

from loadtest.chaos.fleet import metric, parse_metrics
from loadtest.chaos.report import markdown, table, write
from loadtest.chaos.verdict import Verdict, linear_slope, second_half_growth


def test_linear_slope_is_least_squares():
    assert linear_slope([0, 1, 2, 3], [1, 3, 5, 7]) == pytest.approx(2.0)
    assert linear_slope([0, 1, 2], [5, 5, 5]) == 0.0
    assert linear_slope([1], [4]) == 0.0
    assert linear_slope([2, 2], [1, 9]) == 0.0  # no spread in x: no slope


def test_second_half_growth_ignores_warm_up_and_measures_a_leak():
    ts = [float(t) for t in range(0, 100, 10)]
    warm = [100, 200, 300, 400, 500, 500, 500, 500, 500, 500]  # grows while warming up, then flat
    assert second_half_growth(ts, warm) == pytest.approx(0.0)
    leak = [500 + 2 * t for t in ts]  # 2 units a second throughout
    growth = second_half_growth(ts, leak)
    half = [t for t in ts if t >= 45]
    assert growth == pytest.approx(2 * (half[-1] - half[0]))
    assert second_half_growth(ts[:3], leak[:3]) == 0.0  # too few samples to judge


def test_a_verdict_passes_only_with_every_check_passed():
    v = Verdict("x")
    assert not v.passed  # no check: no verdict
    v.check("a", True, "")
    assert v.passed
    v.check("b", False, "why")
    assert not v.passed


def test_parse_metrics_sums_over_matching_labels():
    text = ('# HELP x\nkvfleet_router_replica_ready{replica="http://a:1"} 1.0\n'
            'kvfleet_router_replica_ready{replica="http://b:2"} 0.0\n'
            'kvfleet:num_free_kv_blocks{model_name="m"} 250.0\nvllm:num_preemptions_total 3\n')
    m = parse_metrics(text)
    assert metric(m, "kvfleet_router_replica_ready") == 1.0
    assert metric(m, "kvfleet_router_replica_ready", replica="http://b:2") == 0.0
    assert metric(m, "kvfleet:num_free_kv_blocks") == 250.0
    assert metric(m, "vllm:num_preemptions_total") == 3.0
    assert metric(m, "absent") == 0.0


def test_report_names_failures():
    ok, bad = Verdict("soak"), Verdict("security")
    ok.check("no trend", True, "fine")
    ok.figures["requests"] = 1234
    bad.check("no leak", False, "key in router.log")
    assert "FAIL" in table([ok, bad]).splitlines()[-1]
    md = markdown([ok, bad], {"soak": "Soak doc."}, "python -m loadtest.chaos", "now", 60.0, ["a note"], None)
    assert "some scenarios FAILED" in md and "| no leak | **FAIL** | key in router.log |" in md
    assert "| requests | 1,234 |" in md and "Soak doc." in md and "- a note" in md


def test_write_makes_the_folder_and_plots_the_soak(tmp_path):
    """The first full run lost its report: the plot was saved before docs/ existed."""
    soak = Verdict("soak")
    soak.check("no trend", True, "")
    soak.figures["_series"] = {"t": [0.0, 10.0, 20.0], "rss engine-0": [100.0, 101.0, 100.5],
                               "free engine-0": [256, 250, 256]}
    out = tmp_path / "new" / "reliability.md"
    write(str(out), [soak], {}, "cmd", "now", 1.0, [])
    assert "![soak: RSS and free blocks over time](reliability-soak.png)" in out.read_text()
    assert (tmp_path / "new" / "reliability-soak.png").stat().st_size > 0

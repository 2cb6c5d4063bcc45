"""`kvfleet plan`: a whole run on generated sessions, whose answer meets the targets where one replica fewer does
not (the search itself: tests/router/pools/test_sizing.py)."""

from __future__ import annotations

import pytest

from kvfleet.plan import main


def test_a_plan_meets_the_targets_and_one_replica_fewer_does_not(capsys):
    args = ["--format", "sessions", "--sessions", "120", "--rate", "6", "--ttft-ms", "8000", "--tpot-ms", "100"]
    assert main(args) == 0
    out = capsys.readouterr().out
    plan = out.strip().splitlines()[-1]
    n = int(plan.split("plan: ")[1].split(" replicas")[0])
    rows = {int(line.split()[0]): float(line.split("attainment ")[1].split(",")[0])
            for line in out.splitlines() if "replicas: attainment" in line}
    assert rows[n] >= 0.9 and rows[n - 1] < 0.9


def test_targets_no_fleet_can_meet_stop_the_search(capsys):
    args = ["--format", "sessions", "--sessions", "60", "--rate", "2", "--ttft-ms", "1", "--tpot-ms", "1"]
    assert main(args) == 1
    assert "faster engines, not more of them" in capsys.readouterr().out


def test_bad_flags_are_named(capsys):
    with pytest.raises(SystemExit):
        main(["--rate", "0", "--ttft-ms", "1", "--tpot-ms", "1"])
    assert "--rate must be > 0" in capsys.readouterr().err

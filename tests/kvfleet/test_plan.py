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
    rows = _attainments(out)
    assert rows[n] >= 0.9 and rows[n - 1] < 0.9


def _attainments(out: str) -> dict[int, float]:
    """Each size's attainment from the plan's lines (0.0 for a run stopped once the goal was out of reach)."""
    rows = {}
    for line in out.splitlines():
        if "replicas: attainment" in line:
            value = line.split("attainment ")[1].split(",")[0].split(":")[0]
            rows[int(line.split()[0])] = 0.0 if value.startswith("below") else float(value)
    return rows


def test_a_disaggregated_plan_meets_the_targets_and_a_replica_fewer_on_either_side_does_not(capsys):
    """A tight TPOT target at 4 requests/s: colocated, prefill chunks share the decodes' steps; split, one decode
    replica keeps every stream's pace and four prefill replicas the first tokens."""
    args = ["--format", "sessions", "--sessions", "60", "--rate", "4", "--ttft-ms", "4000", "--tpot-ms", "60",
            "--disagg"]
    assert main(args) == 0
    out = capsys.readouterr().out
    colocated = int(out.split("\nplan: ")[1].split(" replicas")[0])
    plan = out.strip().splitlines()[-1]
    p, d = (int(x) for x in plan.split("plan (disaggregated): ")[1].split(" = ")[0].replace(" prefill + ", " ")
            .replace(" decode", "").split())
    rows = {}
    for line in out.splitlines():
        if " prefill + " in line and "attainment" in line and "plan" not in line:
            words = line.split()
            rows[(int(words[0]), int(words[3]))] = float(words[6])
    assert rows[(p, d)] >= 0.9 and rows[(p - 1, d)] < 0.9 and (d == 1 or rows[(p, d - 1)] < 0.9)
    assert p + d < colocated  # the split needs fewer replicas here


def test_a_size_stops_once_the_goal_is_out_of_reach(capsys):
    """1 replica at 6 requests/s: more than 10% of the 1,200 requests miss long before the last arrives."""
    args = ["--format", "sessions", "--sessions", "300", "--rate", "6", "--ttft-ms", "8000", "--tpot-ms", "100",
            "--max-replicas", "1"]
    assert main(args) == 1
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("     1 replicas"))
    assert "attainment below 0.9: more than 120 of 1,200 requests missed" in line
    assert float(line.split(" by ")[1].split(" s,")[0]) < 200  # the arrivals span 200 s
    assert "up to 1 replicas reach less than 0.9" in out


def test_targets_no_fleet_can_meet_stop_the_search(capsys):
    args = ["--format", "sessions", "--sessions", "60", "--rate", "2", "--ttft-ms", "1", "--tpot-ms", "1"]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "a request alone on an idle replica misses them" in out and "faster engines, not more of them" in out
    assert "replicas:" not in out  # known before any size is simulated


def test_bad_flags_are_named(capsys):
    with pytest.raises(SystemExit):
        main(["--rate", "0", "--ttft-ms", "1", "--tpot-ms", "1"])
    assert "--rate must be > 0" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    """`kvfleet profile --json` of the shipped tiny trace (0.5 requests/s)."""
    import json
    from pathlib import Path

    from kvfleet.profile import profile, read_requests

    path = tmp_path_factory.mktemp("profile") / "profile.json"
    trace = Path(__file__).parent / "data" / "tiny_trace.jsonl"
    path.write_text(json.dumps(profile(read_requests(trace))))
    return str(path)


def test_a_plan_from_a_profile_meets_the_targets_and_one_replica_fewer_does_not(capsys, tiny_profile):
    args = ["--profile", tiny_profile, "--requests", "300", "--rate", "6", "--ttft-ms", "2000", "--tpot-ms", "100"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("300 requests at 6/s")
    n = int(out.strip().splitlines()[-1].split("plan: ")[1].split(" replicas")[0])
    rows = _attainments(out)
    assert n > 1 and rows[n] >= 0.9 and rows[n - 1] < 0.9


def test_a_profile_gives_its_own_rate_and_a_bad_one_is_named(capsys, tiny_profile, tmp_path):
    assert main(["--profile", tiny_profile, "--requests", "60", "--ttft-ms", "2000", "--tpot-ms", "100"]) == 0
    assert capsys.readouterr().out.startswith("60 requests at 0.5/s")
    bad = tmp_path / "bad.json"
    bad.write_text('{"requests": 3}')
    for args, message in ((["--profile", str(bad), "--rate", "1"], "not a `kvfleet profile --json` file"),
                          (["--profile", str(bad)], "--rate is required (the profile has no arrival rate)"),
                          (["--profile", str(tmp_path / "none.json"), "--rate", "1"], "No such file"),
                          (["--profile", tiny_profile, "--trace", "x.jsonl"], "not both")):
        with pytest.raises(SystemExit):
            main([*args, "--ttft-ms", "2000", "--tpot-ms", "100"])
        err = capsys.readouterr().err
        assert message in err

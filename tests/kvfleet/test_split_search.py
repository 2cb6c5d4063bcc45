"""The prefill:decode split `kvfleet plan --disagg` recommends (kvfleet/split_search.py), over hand-made tables of
shares: each side sized on its own target, then the pair grown where it helps most, then shrunk while it meets."""

from __future__ import annotations

import pytest

from kvfleet.split_search import Shares, Split, fewest_split

AMPLE = 16


def _graded(p: int, d: int) -> Shares:
    """TTFT needs 4 prefill replicas and suffers from too few decode slots (a wait before the first token); TPOT
    needs 3 decode replicas."""
    ttft = min(1.0, p / 4) * min(1.0, 0.5 + 0.125 * d)
    tpot = min(1.0, d / 3)
    return Shares(ttft, tpot, min(ttft, tpot))


def _recording(table):
    calls: list[tuple[int, int]] = []

    def run(p: int, d: int) -> Shares:
        calls.append((p, d))
        return table(p, d)
    return run, calls


def test_each_side_is_sized_on_its_own_target_and_the_pair_grows_where_it_helps():
    run, calls = _recording(_graded)
    split = fewest_split(run, 0.9, AMPLE, 64)
    assert split == Split(4, 4, _graded(4, 4))  # (4, 3): TTFT 0.875; (5, 3) too, (4, 4) 1.0: decode grows
    assert (4, AMPLE) in calls and (3, AMPLE) in calls and (AMPLE, 3) in calls and (AMPLE, 2) in calls
    assert (3, 4) in calls and (4, 3) in calls  # neither neighbour with a replica fewer meets the goal
    assert len(calls) == len(set(calls))  # each pair run once


def test_independent_sides_need_no_growing():
    def table(p: int, d: int) -> Shares:
        ttft, tpot = (1.0 if p >= 5 else 0.5), (1.0 if d >= 2 else 0.5)
        return Shares(ttft, tpot, min(ttft, tpot))
    assert fewest_split(table, 0.9, AMPLE, 64) == Split(5, 2, Shares(1.0, 1.0, 1.0))


def test_a_pair_with_a_replica_fewer_that_meets_the_goal_is_taken():
    def table(p: int, d: int) -> Shares:  # noisy runs: (2, 3) meets though (2, AMPLE) fell short of TTFT
        return Shares(0.92, 0.95, 0.91) if (p, d) == (2, 3) else _graded(p + 1, d + 1)
    split = fewest_split(table, 0.9, AMPLE, 64)
    assert split == Split(2, 3, Shares(0.92, 0.95, 0.91))


def test_no_split_when_a_side_cannot_meet_its_target_or_the_pair_outgrows_the_limit():
    def slow_decode(p: int, d: int) -> Shares:
        return Shares(1.0, 0.5, 0.5)  # TPOT met by half of the requests however many decode replicas
    assert fewest_split(slow_decode, 0.9, AMPLE, 64) is None
    assert fewest_split(_graded, 0.9, AMPLE, 7) is None  # (4, 3) found, (4, 4) is 8 replicas
    assert fewest_split(_graded, 0.9, AMPLE, 8) == Split(4, 4, _graded(4, 4))
    with pytest.raises(ValueError, match="ample"):
        fewest_split(_graded, 0.9, 0, 8)

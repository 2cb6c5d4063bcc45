"""`--scheduling-policy priority` (engine/scheduler.py), exactly: the waiting queue by (effective priority,
arrival), aging, the victim (lowest priority, newest first), preemption of a lower priority for a waiting
higher one, and the same tokens whatever the order (the fake model reads every token back through the blocks)."""

from __future__ import annotations

import pytest

from engine.config import SchedulerConfig
from engine.sampling_params import SamplingParams, SamplingParamsError
from tests.engine.test_scheduler_harness import FakeEngine


def ids(out) -> list[tuple[str, int]]:
    return [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled]


def test_waiting_requests_go_by_priority_then_arrival():
    eng = FakeEngine(budget=64, max_num_seqs=2, policy="priority")
    eng.add("low", [1] * 4, priority=5)
    eng.now = 1.0
    eng.add("high", [2] * 4, priority=-1)
    eng.now = 2.0
    eng.add("mid-a", [3] * 4, priority=0)
    eng.add("mid-b", [4] * 4, priority=0)
    out = eng.step()
    assert ids(out) == [("high", 4), ("mid-a", 4)]  # two seats: -1, then the first 0
    assert [s.request_id for s in eng.sched.waiting] == ["mid-b", "low"]


def test_fcfs_ignores_priority():
    eng = FakeEngine(budget=64, max_num_seqs=2)
    eng.add("low", [1] * 4, priority=5)
    eng.add("high", [2] * 4, priority=-1)
    eng.add("mid", [3] * 4)
    assert ids(eng.step()) == [("low", 4), ("high", 4)]


def test_aging_lifts_a_waiting_request_one_level_per_period():
    eng = FakeEngine(budget=64, max_num_seqs=1, policy="priority", aging_s=10.0)
    eng.add("old-low", [1] * 4, max_tokens=1, priority=3)  # arrives at 0
    eng.now = 25.0
    eng.add("new", [2] * 4, max_tokens=1, priority=1)  # arrives at 25
    eng.now = 29.9  # old-low has waited 29.9 s: 3 - 2 = 1, ties with new (1) and arrived first
    assert eng.sched.rank(eng.sched.waiting[0], eng.now) == (1, 10.0, 0)  # due: arrival + aging
    assert ids(eng.step()) == [("old-low", 4)]
    eng2 = FakeEngine(budget=64, max_num_seqs=1, policy="priority", aging_s=10.0)
    eng2.add("old-low", [1] * 4, max_tokens=1, priority=3)
    eng2.now = 15.0
    eng2.add("new", [2] * 4, max_tokens=1, priority=1)
    eng2.now = 19.9  # only one period: 3 - 1 = 2 > 1
    assert ids(eng2.step()) == [("new", 4)]


def test_a_waiting_higher_priority_preempts_the_lowest_running_newest_first():
    eng = FakeEngine(budget=64, max_num_seqs=3, policy="priority")
    eng.add("p2-old", [1] * 4, max_tokens=20, priority=2)
    eng.now = 1.0
    eng.add("p2-new", [2] * 4, max_tokens=20, priority=2)
    eng.now = 2.0
    eng.add("p1", [3] * 4, max_tokens=20, priority=1)
    eng.step()
    assert eng.sched.num_running == 3
    eng.now = 3.0
    urgent = eng.add("urgent", [4] * 4, max_tokens=2, priority=0)
    out = eng.step()  # no seat: the lowest priority (2), newest (p2-new) makes room
    assert [s.request_id for s in out.preempted] == ["p2-new"]
    assert ids(out) == [("p1", 1), ("p2-old", 1), ("urgent", 4)]  # running in admission order (by priority)
    assert [s.request_id for s in eng.sched.waiting] == ["p2-new"]
    eng.run()
    assert urgent.num_output_tokens == 2 and all(s.is_finished for s in eng.seqs)
    assert eng.kv.pool.num_used_blocks == 0


def test_an_equal_or_higher_priority_running_request_is_never_preempted_for_the_queue():
    eng = FakeEngine(budget=64, max_num_seqs=2, policy="priority")
    eng.add("a", [1] * 4, max_tokens=20, priority=0)
    eng.add("b", [2] * 4, max_tokens=20, priority=0)
    eng.step()
    eng.now = 1.0
    eng.add("c", [3] * 4, max_tokens=2, priority=0)
    out = eng.step()
    assert out.preempted == [] and ids(out) == [("a", 1), ("b", 1)]


def test_out_of_blocks_the_victim_is_the_lowest_priority_not_the_newest():
    eng = FakeEngine(num_blocks=6, block_size=4, budget=64, max_num_seqs=8, policy="priority")
    low = eng.add("low", [1] * 8, max_tokens=4, priority=9)  # oldest, lowest priority
    eng.now = 1.0
    high = eng.add("high", [2] * 8, max_tokens=4, priority=0)
    eng.step()
    assert (len(low.block_table), len(high.block_table)) == (2, 2)
    eng.now = 2.0
    eng.add("mid", [3] * 7, max_tokens=1, priority=5)  # takes the last 2 free blocks
    eng.step()
    out = eng.step()  # low and high each need a third block, none is free: low goes, not the newest
    assert "low" in [s.request_id for s in out.preempted] and "high" in [i.seq.request_id for i in out.scheduled]
    eng.run()
    reference = FakeEngine(num_blocks=64, block_size=4, budget=64, max_num_seqs=8)
    for rid, prompt, mt in (("low", [1] * 8, 4), ("high", [2] * 8, 4), ("mid", [3] * 7, 1)):
        reference.add(rid, prompt, max_tokens=mt)
    reference.run()
    assert eng.outputs_by_seq() == reference.outputs_by_seq()  # preemption changes no token
    assert eng.kv.pool.num_used_blocks == 0


def test_priority_is_a_32_bit_integer_and_the_policy_is_checked():
    assert SamplingParams(priority=-5).priority == -5
    with pytest.raises(SamplingParamsError, match="priority must be a 32-bit integer"):
        SamplingParams(priority=2**31)
    with pytest.raises(ValueError, match="scheduling policy must be one of fcfs, priority"):
        SchedulerConfig(policy="lifo")

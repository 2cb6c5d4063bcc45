"""The Virtual Token Counter (engine/fair_share.py): charges, the order of a queue, lifting a returning tenant."""

from __future__ import annotations

from dataclasses import dataclass

from engine.fair_share import GENERATED_WEIGHT, PROMPT_WEIGHT, FairShare


@dataclass
class Req:
    name: str
    fairness_id: str
    num_tokens: int
    num_computed_tokens: int = 0


def names(seqs) -> list[str]:
    return [s.name for s in seqs]


def test_the_papers_default_weights_prompt_1_generated_2():
    assert (PROMPT_WEIGHT, GENERATED_WEIGHT) == (1, 2)
    fair = FairShare()
    fair.enter("a")
    fair.charge("a", prompt_tokens=10, generated_tokens=3)
    assert fair.counters == {"a": 16}


def test_lowest_counter_first_and_one_tenants_burst_does_not_go_ahead_of_the_other():
    fair = FairShare()
    for t in ("a", "b"):
        fair.enter(t)
    fair.charge("a", prompt_tokens=1000)
    queue = [Req("a1", "a", 600), Req("a2", "a", 600), Req("b1", "b", 30), Req("a3", "a", 600), Req("b2", "b", 30)]
    assert names(fair.order(queue)) == ["b1", "b2", "a1", "a2", "a3"]


def test_equal_counters_interleave_by_the_prompt_tokens_each_request_will_be_charged():
    fair = FairShare()
    for t in ("a", "b"):
        fair.enter(t)
    queue = [Req("a1", "a", 100), Req("a2", "a", 100), Req("a3", "a", 100), Req("b1", "b", 100), Req("b2", "b", 50),
             Req("b3", "b", 100)]
    # a1 (a: 0 -> 100), b1 (b: 0 -> 100), a2 (a tie: a2 is ahead in the queue; a -> 200), b2 (b -> 150), b3
    assert names(fair.order(queue)) == ["a1", "b1", "a2", "b2", "b3", "a3"]


def test_a_request_partly_computed_is_projected_at_what_remains():
    fair = FairShare()
    for t in ("a", "b"):
        fair.enter(t)
    queue = [Req("a1", "a", 100, num_computed_tokens=95), Req("a2", "a", 10), Req("b1", "b", 10)]
    # a1 leaves 5 tokens: a is at 5 after it, b at 0 -> b1 before a2
    assert names(fair.order(queue)) == ["a1", "b1", "a2"]


def test_one_tenant_keeps_the_queue_order():
    fair = FairShare()
    fair.enter("")
    queue = [Req(f"r{i}", "", 10 * (5 - i)) for i in range(5)]
    assert fair.order(queue) == queue


def test_a_returning_tenant_is_lifted_to_the_lowest_counter_of_those_with_work():
    fair = FairShare()
    fair.enter("a")
    fair.enter("b")
    fair.charge("a", prompt_tokens=500)
    fair.charge("b", prompt_tokens=800)
    fair.enter("c")  # new: lifted to min(a, b)
    assert fair.counters["c"] == 500
    fair.charge("c", prompt_tokens=10)
    fair.leave("c")
    fair.charge("a", prompt_tokens=1000)  # while c is idle: a 1500, b 800
    fair.enter("c")  # c (510) comes back: lifted to 800, its idle time not banked
    assert fair.counters["c"] == 800
    fair.leave("c")
    fair.charge("c", prompt_tokens=0)
    fair.enter("c")  # c's work ended and it returns before the others move: not lowered
    assert fair.counters["c"] == 800


def test_a_tenant_that_served_more_keeps_its_counter_when_it_returns():
    fair = FairShare()
    fair.enter("a")
    fair.enter("b")
    fair.charge("b", prompt_tokens=900)
    fair.leave("b")
    fair.enter("b")
    assert fair.counters == {"a": 0, "b": 900}


def test_with_nobody_working_a_tenant_is_lifted_to_the_last_one_that_left():
    fair = FairShare()
    fair.enter("a")
    fair.charge("a", prompt_tokens=300)
    fair.leave("a")
    assert fair.active == {} and fair.last_left == 300
    fair.enter("b")
    assert fair.counters["b"] == 300


def test_a_tenant_is_active_until_its_last_sequence_leaves():
    fair = FairShare()
    fair.enter("a")
    fair.enter("a")
    fair.enter("b")
    fair.charge("b", prompt_tokens=50)
    fair.leave("a")
    fair.charge("a", prompt_tokens=10)
    fair.enter("a")  # a still had a sequence: not lifted
    assert fair.counters["a"] == 10 and fair.active == {"a": 2, "b": 1}


def test_idle_tenants_at_or_below_the_floor_are_forgotten():
    fair = FairShare()
    fair.enter("big")
    fair.charge("big", prompt_tokens=10_000)
    for i in range(200):  # each lifted to 10_000 and charged above it: kept while the floor is below them
        fair.enter(f"t{i}")
        fair.charge(f"t{i}", prompt_tokens=1)
        fair.leave(f"t{i}")
    assert len(fair.counters) == 201
    fair.charge("big", prompt_tokens=5)  # the floor (big, the only one with work) passes them
    fair.enter("x")
    fair.leave("x")
    assert fair.counters == {"big": 10_005}
    fair.enter("t0")  # forgotten, it comes back at the floor, as it would have been lifted to
    assert fair.counters["t0"] == 10_005

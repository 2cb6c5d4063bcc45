"""The Virtual Token Counter queue (router/admission/fair_queue.py), with hand-computed orders and counters, and
the paper's bound on the service difference of two backlogged tenants."""

from __future__ import annotations

import random

import pytest

from router.admission.fair_queue import FairQueue, FairQueueConfig, Queued


def q(tenant, t, prompt=10, priority=0) -> Queued:
    return Queued(tenant, t, priority, prompt)


def test_the_smallest_counter_goes_first_and_the_prompt_is_charged_at_dispatch():
    fq = FairQueue()  # prompt x1, output x2
    for i in range(3):
        assert fq.push(q("A", i, prompt=100)) is None
    fq.push(q("B", 3, prompt=10))
    order = []
    for _ in range(4):
        item = fq.pop()
        order.append(item.tenant)
        fq.charge(item.tenant, 0, 5)  # each answered with 5 tokens (x2)
    # A first (tie at 0, its head arrived first): A=110; B: 20; B empty -> A, A: 220, 330
    assert order == ["A", "B", "A", "A"]
    assert fq.counters == {"A": 330.0, "B": 20.0}


def test_within_a_tenant_priority_then_arrival():
    fq = FairQueue()
    fq.push(q("A", 0, priority=1))
    fq.push(q("A", 1, priority=0))
    fq.push(q("A", 2, priority=0))
    assert [fq.pop().arrived for _ in range(3)] == [1, 2, 0]


def test_a_tenant_back_from_idle_is_lifted_to_the_backlogged_minimum():
    fq = FairQueue()
    fq.charge("A", 500, 0)
    fq.charge("C", 800, 0)
    fq.push(q("A", 0))
    fq.push(q("C", 0))
    fq.push(q("B", 1))  # B never ran: 0 would let it take everything for 500 tokens; lifted to min(500, 800)
    assert fq.counters["B"] == 500.0
    while fq.pop() is not None:
        pass
    fq.last_dispatched = "C"
    fq.push(q("D", 2))  # nobody backlogged: lifted to the tenant dispatched last
    assert fq.counters["D"] == fq.counters["C"] == 810.0  # C: 800 + its prompt (10) at dispatch


def test_weights_share_service_three_to_one():
    fq = FairQueue(FairQueueConfig(max_per_tenant=10_000, max_total=20_000))
    fq.set_weight("A", 3.0)
    for i in range(4000):
        fq.push(q("A", i, prompt=30))
        fq.push(q("B", i, prompt=30))
    served = {"A": 0, "B": 0}
    for _ in range(4000):
        item = fq.pop()
        fq.charge(item.tenant, 0, 10)
        served[item.tenant] += 1
    assert served == {"A": 3000, "B": 1000}


def test_two_backlogged_tenants_never_differ_by_more_than_twice_the_largest_request():
    rng = random.Random(7)
    fq = FairQueue(FairQueueConfig(max_per_tenant=10_000, max_total=20_000))
    costs = {}
    for i in range(600):
        for tenant in "AB":
            item = q(tenant, i, prompt=rng.randint(1, 400))
            costs[id(item)] = rng.randint(1, 200)  # its output
            fq.push(item)
    u = max(1 * 400 + 2 * 200, 0)
    service = {"A": 0.0, "B": 0.0}
    worst = 0.0
    while len(fq.queues) == 2:  # both backlogged
        item = fq.pop()
        fq.charge(item.tenant, 0, costs[id(item)])
        service[item.tenant] += item.prompt_tokens + 2 * costs[id(item)]
        worst = max(worst, abs(service["A"] - service["B"]))
    assert worst <= 2 * u
    assert min(service.values()) > 100_000  # a long run, not a trivial one


def test_bounds_timeouts_and_cancellation():
    fq = FairQueue(FairQueueConfig(max_per_tenant=2, max_total=3, timeout_s=5.0))
    a1, a2 = q("A", 0.0), q("A", 1.0)
    assert fq.push(a1) is None and fq.push(a2) is None
    assert fq.push(q("A", 2.0)) == "tenant"
    b1 = q("B", 3.0)
    assert fq.push(b1) is None and fq.push(q("C", 3.0)) == "total"
    assert fq.remove(a2) and not fq.remove(a2) and fq.depth("A") == 1
    assert fq.expired(5.5) == [a1] and len(fq) == 1 and "A" not in fq.queues
    assert fq.expired(8.0) == [] and fq.expired(8.1) == [b1] and fq.pop() is None


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        FairQueueConfig(prompt_weight=0, output_weight=0)
    with pytest.raises(ValueError):
        FairQueue().set_weight("A", 0)


def test_the_gate_lets_one_request_through_per_free_slot_and_meters_only_a_congested_pool():
    import asyncio

    from router.admission.gate import METER_S, Gate
    from router.metrics import RouterMetrics

    now = [0.0]
    room = {"p": 2}
    gate = Gate(FairQueueConfig(), lambda pool: room[pool], RouterMetrics("kv"), clock=lambda: now[0])

    async def run():
        first = [await gate.enter("p", "A", 1.0, 0, 10) for _ in range(2)]
        assert [p.metered for p in first] == [False, False]  # room for both, never congested
        waiting = asyncio.ensure_future(gate.enter("p", "B", 1.0, 0, 10))  # two let through, unsent: no room
        await asyncio.sleep(0)
        assert not waiting.done() and len(gate.queue("p")) == 1
        first[0].sent()
        first[1].sent()
        room["p"] = 1  # one of them ended on the replica
        first[0].done(5)
        b = await waiting
        assert b.metered and gate.pending["p"] == 1
        b.sent()
        b.done(3)
        now[0] = METER_S - 1
        again = await gate.enter("p", "A", 1.0, 0, 1)
        assert again.metered  # congested a moment ago
        again.done(1)  # never sent (say no replica took it): its place is given back
        now[0] = 2 * METER_S
        assert not (await gate.enter("p", "A", 1.0, 0, 1)).metered
        await gate.stop()

    asyncio.run(run())


def test_the_express_lane_lets_a_tenant_under_its_share_past_a_full_pool():
    import asyncio

    from router.admission.gate import Gate
    from router.metrics import RouterMetrics

    room = {"p": 4}
    gate = Gate(FairQueueConfig(), lambda pool: room[pool], RouterMetrics("kv"), seats=lambda pool: 4)

    async def run():
        a = [await gate.enter("p", "A", 1.0, 0, 10) for _ in range(4)]
        for p in a:
            p.sent()
        room["p"] = 0  # full: A holds all 4 seats
        b = await gate.enter("p", "B", 1.0, 0, 10)  # B holds 0 < 4 x 1/2: straight on, ahead
        assert b.express and b.metered
        b2 = await gate.enter("p", "B", 1.0, 0, 10)  # 1 < 2: again
        assert b2.express
        third = asyncio.ensure_future(gate.enter("p", "B", 1.0, 0, 10))  # 2 = its share: it waits
        late_a = asyncio.ensure_future(gate.enter("p", "A", 1.0, 0, 10))  # 4 > 2: waits, behind B by counters
        await asyncio.sleep(0)
        assert not third.done() and not late_a.done() and len(gate.queue("p")) == 2
        b.sent()
        b2.sent()
        a[0].done(8)
        room["p"] = 1
        a[1].done(8)  # a seat frees: B's queued one goes first (its counter is lower)
        assert (await third).tenant == "B" and not late_a.done()
        late_a.cancel()
        await gate.stop()

    asyncio.run(run())

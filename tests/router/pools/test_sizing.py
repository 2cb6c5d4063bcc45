"""The replicas a pool needs for its latency targets (router/pools/sizing.py): the demand window's rate, share and
quantiles, the steady state and the size on hand-made latency models, with exact expectations."""

from __future__ import annotations

import pytest

from router.pools.sizing import Demand, DemandWindow, Served, desired, meets, smallest, steady_state
from router.routing.latency_model import LatencyModel


def model(*coefficients: float) -> LatencyModel:
    m = LatencyModel()
    m.coefficients = coefficients
    return m


# TTFT = 0.05 s + 1 ms per uncached prompt token + 1 ms per prefill token ahead: with 100-token prompts at r
# requests/s a replica's TTFT is t = 0.15 + 0.1 r t, i.e. 0.15 / (1 - 0.1 r), unbounded at r >= 10.
TTFT = (0.05, 0.001, 0.001, 0.0, 0.0, 0.0, 0.0)
# TPOT = 20 ms + 1 ms per sequence decoding.
TPOT = (0.02, 0.001, 0.0, 0.0, 0.0, 0.0)


def demand(rate: float, ttft_s: float | None = 0.3, tpot_s: float | None = 1.0, attainment: float | None = None
           ) -> Demand:
    return Demand(rate, 100.0, 100.0, 100.0, 11.0, ttft_s, tpot_s, attainment)


def test_the_steady_state_is_the_fixed_point_of_littles_law():
    t_first, t_token = steady_state(model(*TTFT), model(*TPOT), 4.0, demand(12.0))
    assert t_first == pytest.approx(0.15 / 0.6, rel=1e-3)
    # p = 0.02 + 0.001 * (held + 1), held = 4 * (0.25 + 10 p): p = 0.022 / 0.96
    assert t_token == pytest.approx(0.022 / 0.96, rel=1e-3)
    assert steady_state(model(*TTFT), model(*TPOT), 10.0, demand(12.0)) is None  # the prefill falls behind
    assert steady_state(LatencyModel(), model(*TPOT), 1.0, demand(12.0)) is None  # no model yet


def test_the_size_is_the_fewest_replicas_predicted_to_meet_both_targets():
    ttft, tpot = model(*TTFT), model(*TPOT)
    # TTFT 0.3 s holds at r <= 5: 12 req/s need 3 replicas (r = 4: 0.25 s), 2 (r = 6: 0.375 s) do not
    assert not meets(ttft, tpot, demand(12.0), 2) and meets(ttft, tpot, demand(12.0), 3)
    assert desired(ttft, tpot, demand(12.0), current=1) == 3
    assert desired(ttft, tpot, demand(12.0), current=8) == 3  # attainment unknown: the models' answer
    # a TPOT target of 21.9 ms binds first: r = 2.4 (5 replicas) predicts 22.0 ms, r = 2 (6 replicas) 21.8 ms
    assert desired(ttft, tpot, demand(12.0, tpot_s=0.0219), current=1) == 6
    assert desired(ttft, tpot, demand(12.0, ttft_s=None, tpot_s=0.0219), current=1) == 6
    # a target below the idle replica's time: no size meets it, more replicas do not help, whatever attainment says
    assert desired(ttft, tpot, demand(12.0, ttft_s=0.1), current=1) == 0
    assert desired(ttft, tpot, demand(12.0, ttft_s=0.1, attainment=0.0), current=1) == 0
    assert desired(ttft, tpot, demand(1191.0), current=1) == 239  # r <= 5: 1191 / 239 = 4.98, 1191 / 238 = 5.004


def test_attainment_below_the_goal_asks_for_more_than_the_pool_has():
    ttft, tpot = model(*TTFT), model(*TPOT)
    assert desired(ttft, tpot, demand(12.0, attainment=0.5), current=4) == 5  # the models said 3
    assert desired(ttft, tpot, demand(12.0, attainment=0.5), current=2) == 3
    assert desired(ttft, tpot, demand(12.0, attainment=0.5), current=10) == 12  # 15% more: past the HPA's tolerance
    assert desired(ttft, tpot, demand(12.0, attainment=0.95), current=4) == 3  # holds: smaller is fine
    # no models yet: only attainment speaks
    assert desired(LatencyModel(), tpot, demand(12.0, attainment=0.5), current=4) == 5
    assert desired(LatencyModel(), tpot, demand(12.0, attainment=0.95), current=4) == 0
    assert desired(ttft, tpot, None, current=4) == 0  # no targets in the window: they ask for nothing


def served(at: float, ttft_s: float | None = 0.5, met: bool | None = True, cached: int = 0,
           output: int | None = 20, duration_s: float = 0.5) -> Served:
    return Served(at, 100, cached, output, duration_s, ttft_s, None, met)


def test_the_window_counts_the_rate_over_this_routers_share_of_the_requests_in_flight():
    w = DemandWindow(window_s=10.0, min_requests=4, goal=0.9)
    for i in range(20):  # 2 req/s for 10 s, 0.5 s each: 1 in flight on average (Little's law)
        w.record(served(i * 0.5, cached=40 if i % 2 else 0, met=i % 4 != 0))
        w.observe_occupancy(i * 0.5, 2.0 if i % 2 else 2.5)  # the engines hold 2.25: 1 / 2.25 came through here
    d = w.demand(10.0)
    assert d.rate == pytest.approx(2.0 * 2.25)
    assert (d.prompt_tokens, d.uncached_tokens, d.uncached_tail, d.output_tokens) == (100.0, 80.0, 100.0, 20.0)
    assert d.ttft_target_s == 0.5 and d.tpot_target_s is None
    assert d.attainment == 15 / 20
    assert w.demand(10.0 + 10.5) is None  # all of it out of the window


def test_the_window_needs_requests_with_targets_and_takes_the_strict_end_of_them():
    w = DemandWindow(window_s=60.0, min_requests=4, goal=0.9)
    for i in range(3):
        w.record(served(float(i)))
    assert w.demand(3.0) is None  # fewer than min_requests
    w.record(served(3.0, ttft_s=None, met=None))
    d = w.demand(4.0)
    assert d.rate == pytest.approx(4 / 4.0)  # the span so far, not the whole window; no occupancy seen: share 1
    assert d.attainment == 1.0
    w2 = DemandWindow(window_s=60.0, min_requests=2)
    for i in range(5):
        w2.record(served(float(i), ttft_s=None, met=None))
    assert w2.demand(5.0) is None  # no target: nothing to size for
    w3 = DemandWindow(window_s=60.0, min_requests=1, goal=0.9)
    for i, t in enumerate([0.2] + [1.0] * 19):  # 1 in 20 strict: 90% have targets at least 1.0 s
        w3.record(served(float(i), ttft_s=t))
    assert w3.demand(20.0).ttft_target_s == 1.0
    w3.record(served(20.0, ttft_s=0.2))
    w3.record(served(20.0, ttft_s=0.2))  # 3 in 22 strict: more than 10%
    assert w3.demand(20.0).ttft_target_s == 0.2
    w3.record(served(20.0, ttft_s=0.5, met=False, output=None, duration_s=0.0))  # a refusal: a miss, no output
    assert w3.demand(20.0).output_tokens == 20.0 and w3.demand(20.0).attainment == 22 / 23


def test_the_ttft_target_is_checked_with_the_prompts_of_the_requests_that_carry_it():
    """A batch class without targets sends long prompts beside short targeted ones (the live goodput bench: the
    tail was a batch prompt, the target unattainable at any size, and the pool asked for nothing at 0.6
    attainment). Its prompts count in the load (the mean), not in the tail the TTFT target is checked with."""
    w = DemandWindow(window_s=60.0, min_requests=4, goal=0.9)
    for i in range(12):
        w.record(Served(float(i), 100, 0, 20, 0.5, 0.3, None, i % 2 == 0))  # targeted: 100-token prompts
    for i in range(4):
        w.record(Served(float(i), 1300, 0, 64, 4.0, None, None, None))  # batch: 1,300 tokens, no target
    d = w.demand(12.0)
    assert d.uncached_tail == 100.0 and d.uncached_tokens == (12 * 100 + 4 * 1300) / 16 and d.attainment == 0.5
    ttft, tpot = model(*TTFT), model(*TPOT)
    assert desired(ttft, tpot, d, current=2) >= 3  # more replicas: the targets are attainable at some size
    untimed = DemandWindow(window_s=60.0, min_requests=4, goal=0.9)
    for i in range(6):
        untimed.record(Served(float(i), 1300 if i % 3 == 0 else 100, 0, 20, 0.5, None, 1.0, True))  # TPOT only
    assert untimed.demand(6.0).uncached_tail == 1300.0  # no TTFT target: all prompts, as before


@pytest.mark.parametrize("threshold", [1, 2, 3, 7, 8, 9, 100, 512])
def test_the_search_finds_the_smallest_size_and_tries_the_one_below(threshold):
    tried = []

    def ok(n):
        tried.append(n)
        return n >= threshold

    assert smallest(ok, 512) == threshold
    assert threshold - 1 in tried or threshold == 1
    assert len(tried) <= 2 * 10  # doubling then bisection: logarithmic


def test_no_size_when_even_the_largest_misses_or_more_stopped_helping():
    assert smallest(lambda n: False, 64) is None
    calls = []
    assert smallest(lambda n: calls.append(n) or False, 512, stalled=lambda: len(calls) >= 3) is None
    assert calls == [1, 2, 4]


def test_bad_window_settings_are_refused():
    with pytest.raises(ValueError, match="window_s"):
        DemandWindow(window_s=0)
    with pytest.raises(ValueError, match="goal"):
        DemandWindow(goal=1.5)


def test_a_router_holding_more_than_the_engines_report_counts_as_all_of_the_traffic():
    w = DemandWindow(window_s=10.0, min_requests=1)
    for i in range(10):
        w.record(served(float(i), duration_s=2.0))  # 2 in flight on average, queued at the router part of it
        w.observe_occupancy(float(i), 1.0)
    assert w.demand(10.0).rate == pytest.approx(1.0)  # share capped at 1


def test_the_window_forgets_as_it_records_with_nobody_asking():
    w = DemandWindow(window_s=10.0, min_requests=1)
    for i in range(1000):
        w.record(served(float(i)))
        w.observe_occupancy(float(i), 1.0)
    assert len(w._served) == 11 and len(w._occupancy) == 11  # seconds 989..999

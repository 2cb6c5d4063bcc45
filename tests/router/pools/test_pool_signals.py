"""A pool's signals over the router's sliding window, with exact expectations."""

from router.pools.degradation import Signals
from router.pools.signals import SignalWindow, p99


def test_p99_is_nearest_rank():
    assert p99([5.0]) == 5.0
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([float(i) for i in range(1, 201)]) == 198.0
    assert p99([3.0, 1.0, 2.0]) == 3.0


def test_fewer_than_min_requests_is_unknown():
    w = SignalWindow(window_s=10, min_requests=3)
    w.record(0.0, False, 0.1, 0.01)
    w.record(1.0, True, 0.2, 0.02)
    assert w.signals(2.0, None) == Signals()
    w.record(2.0, False, None, None)  # a non-streamed request: counts toward the error rate only
    assert w.signals(2.0, 0.5) == Signals(error_rate=1 / 3, kv_usage=0.5)
    w.record(3.0, False, 0.4, 0.04)
    assert w.signals(3.0, None) == Signals(p99_ttft_s=0.4, p99_tpot_s=0.04, error_rate=0.25)


def test_old_requests_leave_the_window():
    w = SignalWindow(window_s=10, min_requests=2)
    for t in range(5):
        w.record(float(t), t < 2, 1.0 + t, None)
    assert w.signals(5.0, None) == Signals(p99_ttft_s=5.0, error_rate=0.4)
    assert w.signals(12.0, None) == Signals(p99_ttft_s=5.0, error_rate=0.0)  # t=0, 1 gone
    assert w.signals(13.5, None) == Signals()  # only t=4 is left


def test_oom_events_are_the_counters_rise_within_the_window():
    w = SignalWindow(window_s=10, min_requests=1)
    assert w.signals(0.0, None).oom_events is None  # no scrape yet
    w.observe_counters("a", 0.0, 3, 0)  # 3 OOMs before we looked: not counted
    w.observe_counters("b", 0.0, 0, 0)
    assert w.signals(0.0, None).oom_events == 0
    w.observe_counters("a", 2.0, 4, 0)
    w.observe_counters("b", 2.0, 2, 0)
    assert w.signals(2.0, None).oom_events == 3
    w.observe_counters("a", 11.0, 4, 0)
    w.observe_counters("b", 11.0, 2, 0)
    assert w.signals(11.0, None).oom_events == 3  # the baseline is the last sample at or before t=1
    w.observe_counters("a", 13.0, 4, 0)
    w.observe_counters("b", 13.0, 2, 0)
    assert w.signals(13.0, None).oom_events == 0  # the rise at t=2 left the window
    w.observe_counters("b", 14.0, 1, 0)  # b restarted: its new count is new OOMs
    assert w.signals(14.0, None).oom_events == 1
    w.retain({"a"})
    assert w.signals(14.0, None).oom_events == 0


def test_block_allocation_failures_rise_like_ooms():
    w = SignalWindow(window_s=10, min_requests=1)
    w.observe_counters("a", 0.0, 0, 100)
    w.observe_counters("a", 5.0, 0, 700)
    w.observe_counters("b", 5.0, 0, 30)
    assert w.signals(5.0, None) == Signals(oom_events=0, alloc_failures=600)

"""One pool's degradation signals, measured by the router over a sliding window. Pure: the router records each
request's outcome and latencies and each scrape's OOM counter with `now` passed in, and asks for `signals`.

- p99 TTFT / TPOT: over the streamed requests that finished in the window (the router sees their first
  token; for a chat stream, the chunk after the opening role chunk). Non-streamed requests count toward the
  error rate only: their latency mixes prefill and decode. Unknown with fewer than `min_requests` samples.
- error rate: requests that failed (no replica could serve, a replica failed, 5xx) over all requests that
  finished in the window; unknown with fewer than `min_requests`.
- OOM events and block-allocation failures: per replica, how much its `kvfleet:oom_events_total` and
  `kvfleet:block_allocation_failures_total` counters rose in the window, summed over the pool (a counter that
  went down is a restarted engine: its new value counts); unknown before any replica was scraped.
- KV usage: the pool's mean, passed in from the scrapes.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from router.pools.degradation import Signals


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank q quantile (0 < q <= 1) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def p99(values: list[float]) -> float:
    return quantile(values, 0.99)


class SignalWindow:
    def __init__(self, window_s: float, min_requests: int):
        self.window_s, self.min_requests = window_s, min_requests
        self._requests: deque[tuple[float, bool]] = deque()  # (finished at, failed)
        self._ttft: deque[tuple[float, float]] = deque()
        self._tpot: deque[tuple[float, float]] = deque()
        # counter name -> replica -> (scraped at, counter value)
        self._counters: dict[str, dict[str, deque[tuple[float, float]]]] = {"oom": {}, "alloc": {}}

    def record(self, now: float, failed: bool, ttft_s: float | None = None, tpot_s: float | None = None) -> None:
        self._requests.append((now, failed))
        if ttft_s is not None:
            self._ttft.append((now, ttft_s))
        if tpot_s is not None:
            self._tpot.append((now, tpot_s))

    def observe_counters(self, replica: str, now: float, oom_events: float, alloc_failures: float) -> None:
        """One scrape of a replica's OOM and block-allocation-failure counters."""
        for name, value in (("oom", oom_events), ("alloc", alloc_failures)):
            self._counters[name].setdefault(replica, deque()).append((now, value))

    def retain(self, replicas) -> None:
        """Forget the counters of replicas that left the pool."""
        for per_replica in self._counters.values():
            for url in [u for u in per_replica if u not in replicas]:
                del per_replica[url]

    def signals(self, now: float, kv_usage: float | None) -> Signals:
        start = now - self.window_s
        for q in (self._requests, self._ttft, self._tpot):
            while q and q[0][0] < start:
                q.popleft()
        n = len(self._requests)
        return Signals(
            p99_ttft_s=p99([v for _, v in self._ttft]) if len(self._ttft) >= self.min_requests else None,
            p99_tpot_s=p99([v for _, v in self._tpot]) if len(self._tpot) >= self.min_requests else None,
            error_rate=sum(failed for _, failed in self._requests) / n if n >= self.min_requests else None,
            oom_events=self._rise("oom", start),
            alloc_failures=self._rise("alloc", start),
            kv_usage=kv_usage,
        )

    def _rise(self, counter: str, start: float) -> int | None:
        per_replica = self._counters[counter]
        if not per_replica:
            return None
        total = 0.0
        for q in per_replica.values():
            while len(q) > 1 and q[1][0] <= start:  # keep the last sample at or before the window's start
                q.popleft()
            base, last = q[0][1], q[-1][1]
            total += last - base if last >= base else last
        return int(total)

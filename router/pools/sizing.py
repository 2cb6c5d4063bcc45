"""The replicas a pool needs for its requests' latency targets, from what the router saw of them over a sliding
window and its own latency models (router/routing/latency_model.py): the figure the routers export per pool
(`kvfleet_router_pool_desired_replicas`) and the chart's HPA or KEDA can scale on. Pure: `now` is passed in.

The window (`DemandWindow`) holds each finished request of the pool (its prompt tokens, those the engine had
cached, its output tokens, its targets and whether it met them) and each one refused 429 `slo_unattainable` (wanted
and not served: a miss). From them, `Demand`: the fleet's request rate (this router's, over its share of the
pool's requests: the routers split the traffic), mean prompt, uncached and output tokens, the targets and the
attainment. The share is this router's mean requests in flight (by Little's law, the sum of its requests'
durations over the window's span) over everyone's (the running and waiting requests the pool's engines report,
sampled every second): both time averages, so neither is biased by when a request happens to end.

`steady_state` answers what a replica predicts at a per-replica rate r: by Little's law a replica holds
b = r * (TTFT + (output - 1) * TPOT) requests, r * TTFT of them still waiting for their first token with their
uncached prompts ahead of a new one; TTFT and TPOT are the models' predictions for that load (a request's
uncached prompt at the `goal` quantile of the requests with a TTFT target: long prompts miss first), iterated from an idle replica up to the
fixed point; none where it does not converge (the replica's prefill falls behind: its queue grows without end).

`desired`: the fewest replicas at which both predictions meet the targets (each the `1 - goal` quantile of the
requests' own: `goal` of the requests have targets at least that loose). The models are fitted on what was seen,
so the observed attainment corrects them: below `goal`, at least 15% more replicas than the pool has (one at least:
past the HPA's 10% tolerance); a smaller pool only while attainment holds. 0 (the targets ask for nothing; KV usage and waiting requests still scale the
pool, the largest proposal wins) while no request of the window had a target, or too few came, and for targets
not even a replica with next to no load is predicted to meet: more replicas would not help.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from router.pools.signals import quantile
from router.routing.latency_model import LatencyModel, TPOTFeatures, TTFTFeatures

MAX_REPLICAS = 1024  # the largest size `desired` answers
ITERATIONS = 200  # fixed-point steps of `steady_state`
TOLERANCE = 1e-4  # relative change below which the fixed point is reached
STEP_UP = 1.15  # attainment below the goal asks for this many times the replicas at least (one more at least):
# past the 10% an HPA tolerates before it acts


@dataclass(frozen=True, slots=True)
class Served:
    at: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int | None  # None: refused, or its usage unknown
    duration_s: float  # from admission to its end (0: refused)
    ttft_target_s: float | None
    tpot_target_s: float | None
    met: bool | None  # both targets met (None: no target, or not measurable: not streamed)


@dataclass(frozen=True, slots=True)
class Demand:
    rate: float  # requests/s the pool is asked for, all routers
    prompt_tokens: float  # mean
    uncached_tokens: float  # mean
    uncached_tail: float  # at the goal quantile, of the requests with a TTFT target: the prompt it is checked with
    output_tokens: float  # mean
    ttft_target_s: float | None
    tpot_target_s: float | None
    attainment: float | None  # met / (met + missed) of the requests with targets; None before any


class DemandWindow:
    def __init__(self, window_s: float = 60.0, min_requests: int = 10, goal: float = 0.9):
        if not window_s > 0 or min_requests < 1 or not 0 < goal <= 1:
            raise ValueError(f"need window_s > 0, min_requests >= 1, 0 < goal <= 1; got {window_s}, {min_requests}, "
                             f"{goal}")
        self.window_s, self.min_requests, self.goal = window_s, min_requests, goal
        self._served: deque[Served] = deque()
        self._occupancy: deque[tuple[float, float]] = deque()  # (at, running + waiting on the pool's engines)
        self._since = math.inf  # when the first request was recorded (the rate's span until a window is full)

    def record(self, s: Served) -> None:
        self._served.append(s)
        self._since = min(self._since, s.at)
        self._forget(s.at)

    def observe_occupancy(self, now: float, requests: float) -> None:
        """Everyone's requests running and waiting on the pool's engines (scraped), sampled at a steady pace."""
        self._occupancy.append((now, requests))
        self._forget(now)

    def _forget(self, now: float) -> None:
        """Drop what is older than the window (on every record: memory stays bounded with nobody asking)."""
        start = now - self.window_s
        while self._served and self._served[0].at < start:
            self._served.popleft()
        while self._occupancy and self._occupancy[0][0] < start:
            self._occupancy.popleft()

    def demand(self, now: float) -> Demand | None:
        self._forget(now)
        served = list(self._served)
        if len(served) < self.min_requests:
            return None
        ttft_targets = [s.ttft_target_s for s in served if s.ttft_target_s is not None]
        tpot_targets = [s.tpot_target_s for s in served if s.tpot_target_s is not None]
        if not ttft_targets and not tpot_targets:
            return None
        span = min(self.window_s, max(now - self._since, 1e-9))
        own = sum(s.duration_s for s in served) / span
        everyone = sum(n for _, n in self._occupancy) / len(self._occupancy) if self._occupancy else 0.0
        share = min(own / everyone, 1.0) if everyone > 0 and own > 0 else 1.0
        outputs = [s.output_tokens for s in served if s.output_tokens is not None]
        uncached = [max(s.prompt_tokens - s.cached_tokens, 0) for s in served]
        # the TTFT target is checked with the prompts of the requests that carry one: a batch class's long prompts
        # load the replicas (the mean) but owe no first token by a deadline (a tail of theirs would make the target
        # look unattainable at any size, and the pool ask for nothing)
        timed = [max(s.prompt_tokens - s.cached_tokens, 0) for s in served if s.ttft_target_s is not None]
        judged = [s.met for s in served if s.met is not None]
        loose = 1.0 - self.goal
        return Demand(rate=len(served) / span / max(share, 1e-3),
                      prompt_tokens=sum(s.prompt_tokens for s in served) / len(served),
                      uncached_tokens=sum(uncached) / len(uncached),
                      uncached_tail=quantile(timed or uncached, self.goal),
                      output_tokens=sum(outputs) / len(outputs) if outputs else 1.0,
                      ttft_target_s=quantile(ttft_targets, loose) if ttft_targets else None,
                      tpot_target_s=quantile(tpot_targets, loose) if tpot_targets else None,
                      attainment=sum(judged) / len(judged) if judged else None)


def steady_state(ttft: LatencyModel, tpot: LatencyModel, rate: float, d: Demand) -> tuple[float, float] | None:
    """(TTFT, TPOT) seconds the models predict on a replica taking `rate` requests/s of the demand `d`; None where
    the load has no fixed point (or a model is not ready)."""
    t_first = t_token = 0.0
    out = max(d.output_tokens, 1.0)
    for _ in range(ITERATIONS):
        waiting = rate * t_first  # requests there without a first token yet
        held = rate * (t_first + (out - 1.0) * t_token)  # all its requests (Little's law)
        ahead = waiting * d.uncached_tokens
        a = ttft.predict(TTFTFeatures.of(d.uncached_tail, ahead, 0.0, held))
        b = tpot.predict(TPOTFeatures(held + 1.0, held * (d.prompt_tokens + out / 2.0) + d.prompt_tokens, ahead,
                                      0.0, rate * d.uncached_tokens))
        if a is None or b is None:
            return None
        done = abs(a - t_first) <= TOLERANCE * a and abs(b - t_token) <= TOLERANCE * b
        t_first, t_token = a, b
        if done:
            return t_first, t_token
        if held > 1e6:
            return None
    return None


def meets(ttft: LatencyModel, tpot: LatencyModel, d: Demand, replicas: int) -> bool:
    """Whether `replicas` replicas sharing the demand are predicted to meet both of its targets."""
    got = steady_state(ttft, tpot, d.rate / replicas, d)
    if got is None:
        return False
    t_first, t_token = got
    return ((d.ttft_target_s is None or t_first <= d.ttft_target_s)
            and (d.tpot_target_s is None or t_token <= d.tpot_target_s))


def smallest(ok: Callable[[int], bool], most: int, stalled: Callable[[], bool] = lambda: False) -> int | None:
    """The smallest n in [1, most] with ok(n), for an `ok` that stays true once true (doubling, then bisection);
    None when not even `most` is, or when `stalled()` says more replicas stopped helping (kvfleet plan)."""
    hi = 1
    while not ok(hi):
        if hi >= most or stalled():
            return None
        hi = min(2 * hi, most)
    lo = hi // 2  # ok(lo) was false (or lo == 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


def desired(ttft: LatencyModel, tpot: LatencyModel, d: Demand | None, current: int, goal: float = 0.9) -> int:
    """The replicas the pool's latency targets need (module docstring); 0 when they ask for none. `current`: its
    routable replicas now."""
    if d is None:
        return 0
    missing = d.attainment is not None and d.attainment < goal
    more = max(current + 1, math.ceil(current * STEP_UP))
    if not (ttft.ready and tpot.ready):  # no prediction yet: only what attainment says
        return more if missing else 0
    n = smallest(lambda k: meets(ttft, tpot, d, k), MAX_REPLICAS)
    if n is None:  # not even an all but idle replica meets them: more replicas do not help
        return 0
    return max(n, more) if missing else n

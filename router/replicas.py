"""Per-replica state: readiness, scraped load (with a staleness bound), this router's in-flight work, and a
circuit breaker. Pure state with the clock passed in; the I/O that feeds it lives in fleet.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

from router.policy import ReplicaView

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"
CIRCUIT_STATES = (CLOSED, OPEN, HALF_OPEN)


class CircuitBreaker:
    """closed --N consecutive failures--> open --open_s elapsed--> half-open (one probe request)
    --probe succeeds--> closed / --probe fails--> open again."""

    def __init__(self, failure_threshold: int, open_s: float):
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self._state = CLOSED
        self.failures = 0
        self.opened_at = -math.inf
        self.probing = False

    def state(self, now: float) -> str:
        if self._state == OPEN and now - self.opened_at >= self.open_s:
            return HALF_OPEN
        return self._state

    def can_try(self, now: float) -> bool:
        s = self.state(now)
        return s == CLOSED or (s == HALF_OPEN and not self.probing)

    def on_attempt(self, now: float) -> None:
        if self.state(now) == HALF_OPEN:
            self._state = HALF_OPEN
            self.probing = True

    def on_abandoned(self) -> None:
        """The attempt ended without a verdict on the replica (client gone): free the probe slot."""
        self.probing = False

    def on_success(self) -> None:
        self._state, self.failures, self.probing = CLOSED, 0, False

    def on_failure(self, now: float) -> None:
        if self.state(now) == HALF_OPEN:
            self._open(now)
            return
        if self._state == OPEN:
            return
        self.failures += 1
        if self.failures >= self.failure_threshold:
            self._open(now)

    def _open(self, now: float) -> None:
        self._state, self.opened_at, self.probing = OPEN, now, False


@dataclass(frozen=True, slots=True)
class EngineLoad:
    kv_usage: float = 0.0
    running: int = 0
    waiting: int = 0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0


_LOAD_METRICS = {
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",  # older vLLM name
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:prefix_cache_queries": "prefix_queries",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:prefix_cache_hits": "prefix_hits",
}


def parse_engine_metrics(text: str) -> EngineLoad:
    """The load figures from an engine's Prometheus text (vLLM names), summed over label sets."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        end = len(line)
        for ch in "{ ":
            k = line.find(ch)
            if 0 <= k < end:
                end = k
        field = _LOAD_METRICS.get(line[:end])
        if field is None:
            continue
        value_part = line[line.rfind("}") + 1:] if line[end:end + 1] == "{" else line[end:]
        try:
            value = float(value_part.split()[0])
        except (ValueError, IndexError):
            continue
        sums[field] = sums.get(field, 0.0) + value
    return EngineLoad(kv_usage=sums.get("kv_usage", 0.0), running=int(sums.get("running", 0)),
                      waiting=int(sums.get("waiting", 0)), prefix_queries=sums.get("prefix_queries", 0.0),
                      prefix_hits=sums.get("prefix_hits", 0.0))


@dataclass(slots=True)
class Ticket:
    """One request this router has in flight on a replica."""

    epoch: int
    tokens: int


class ReplicaState:
    def __init__(self, url: str, breaker: CircuitBreaker):
        self.url = url
        self.breaker = breaker
        self.ready: bool = False  # the last /ready check answered 200
        self.load: EngineLoad | None = None
        self.scraped_at: float = -math.inf
        self.inflight = 0
        self.new_requests = 0  # dispatched in the current scrape epoch and still in flight
        self.new_tokens = 0
        self.finished = 0  # dispatched before the last scrape, finished after it
        self.epoch = 0
        self.kv_events = "connecting"  # connecting | live | unavailable (no KV event endpoint)

    def routable(self, now: float) -> bool:
        return self.ready and self.breaker.can_try(now)

    def load_known(self, now: float, stale_s: float) -> bool:
        return self.load is not None and now - self.scraped_at <= stale_s

    def view(self, now: float, stale_s: float, cached_tokens: int = 0, excluded: bool = False) -> ReplicaView:
        known = self.load_known(now, stale_s)
        load = self.load if known and self.load is not None else EngineLoad()
        return ReplicaView(url=self.url, routable=not excluded and self.routable(now), load_known=known,
                           kv_usage=load.kv_usage, running=load.running, waiting=load.waiting,
                           new_requests=self.new_requests, new_tokens=self.new_tokens, finished=self.finished,
                           inflight=self.inflight,
                           cached_tokens=cached_tokens)

    def on_scrape(self, load: EngineLoad, now: float) -> None:
        """A fresh scrape already counts everything sent before it: start a new epoch."""
        self.load, self.scraped_at = load, now
        self.epoch += 1
        self.new_requests = self.new_tokens = self.finished = 0

    def on_scrape_failed(self) -> None:
        self.load = None

    def on_dispatch(self, uncached_tokens: int) -> Ticket:
        self.inflight += 1
        self.new_requests += 1
        self.new_tokens += uncached_tokens
        return Ticket(self.epoch, uncached_tokens)

    def on_done(self, ticket: Ticket) -> None:
        self.inflight -= 1
        if ticket.epoch == self.epoch:
            self.new_requests -= 1
            self.new_tokens -= ticket.tokens
        else:  # the last scrape counted it as running or waiting; it is gone now
            self.finished += 1

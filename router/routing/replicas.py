"""Per-replica state: readiness, scraped load (with a staleness bound), this router's in-flight work, and a
circuit breaker. Pure state with the clock passed in; the I/O that feeds it lives in fleet.py."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from router.routing.latency_model import TPOTFeatures, TTFTFeatures
from router.routing.policies import ReplicaView
from router.states import CircuitState, KVEventsState


class CircuitBreaker:
    """closed --N consecutive failures--> open --open_s elapsed--> half-open (one probe request)
    --probe succeeds--> closed / --probe fails--> open again."""

    def __init__(self, failure_threshold: int, open_s: float):
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self._state = CircuitState.CLOSED
        self.failures = 0
        self.opened_at = -math.inf
        self.probing = False

    def state(self, now: float) -> CircuitState:
        if self._state is CircuitState.OPEN and now - self.opened_at >= self.open_s:
            return CircuitState.HALF_OPEN
        return self._state

    def can_try(self, now: float) -> bool:
        s = self.state(now)
        return s is CircuitState.CLOSED or (s is CircuitState.HALF_OPEN and not self.probing)

    def on_attempt(self, now: float) -> None:
        if self.state(now) is CircuitState.HALF_OPEN:
            self._state = CircuitState.HALF_OPEN
            self.probing = True

    def on_abandoned(self) -> None:
        """The attempt ended without a verdict on the replica (client gone): free the probe slot."""
        self.probing = False

    def on_success(self) -> None:
        self._state, self.failures, self.probing = CircuitState.CLOSED, 0, False

    def on_failure(self, now: float) -> None:
        if self.state(now) is CircuitState.HALF_OPEN:
            self._open(now)
            return
        if self._state is CircuitState.OPEN:
            return
        self.failures += 1
        if self.failures >= self.failure_threshold:
            self._open(now)

    def _open(self, now: float) -> None:
        self._state, self.opened_at, self.probing = CircuitState.OPEN, now, False


@dataclass(frozen=True, slots=True)
class LoRAInfo:
    """vLLM's `vllm:lora_requests_info` (kvfleet exports it too): the adapters of the running and of the
    waiting requests, and how many adapters one step can run (--max-loras)."""

    running: frozenset[str] = frozenset()
    waiting: frozenset[str] = frozenset()
    max_lora: int = 0

    @property
    def held(self) -> frozenset[str]:
        """Adapters the engine has loaded for requests it holds now."""
        return self.running | self.waiting

    def slots_full_without(self, adapter: str) -> bool:
        """Every slot runs another adapter: a request for this one waits until one of them drains."""
        return 0 < self.max_lora <= len(self.running) and adapter not in self.running


@dataclass(frozen=True, slots=True)
class EngineLoad:
    kv_usage: float = 0.0
    running: int = 0
    waiting: int = 0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    kv_capacity_tokens: float = 0.0  # num_gpu_blocks * block_size from vllm:cache_config_info (0: unknown)
    engine: str = "unknown"  # kvfleet | vllm | sglang, from the metric names it exports
    oom_events: float = 0.0  # kvfleet:oom_events_total: steps that failed for memory (and were recovered)
    alloc_failures: float = 0.0  # kvfleet:block_allocation_failures_total
    lora: LoRAInfo | None = None  # vllm:lora_requests_info's latest sample (None: the engine serves no adapters)
    # kvfleet engines' measured rates, cumulative (router/routing/pull_rates.py): prefill seconds and the prompt
    # tokens they computed, pull transfer seconds and the tokens pulled
    prefill_seconds: float = 0.0
    prefill_tokens: float = 0.0
    pull_seconds: float = 0.0
    pulled_tokens: float = 0.0

    @property
    def kv_tokens(self) -> float:
        """Tokens of KV cache held by running requests (their whole contexts)."""
        return self.kv_usage * self.kv_capacity_tokens


_LOAD_METRICS = {
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",  # older vLLM name
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:prefix_cache_queries": "prefix_queries",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:prefix_cache_hits": "prefix_hits",
    "sglang:token_usage": "kv_usage",  # SGLang: fraction of its KV token pool in use
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    "sglang:max_total_num_tokens": "kv_capacity_tokens",
    "kvfleet:oom_events_total": "oom_events",
    "kvfleet:block_allocation_failures_total": "alloc_failures",
    "kvfleet:prefill_seconds_total": "prefill_seconds",
    "kvfleet:prefill_computed_tokens_total": "prefill_tokens",
    "kvfleet:kv_pull_transfer_seconds_total": "pull_seconds",
    "kvfleet:kv_pulled_tokens_total": "pulled_tokens",
}


_BLOCK_SIZE = re.compile(r'[{,]block_size="(\d+)"')
_LORA_LABELS = {key: re.compile(r'[{,]\s*' + key + r'="([^"]*)"')
                for key in ("running_lora_adapters", "waiting_lora_adapters", "max_lora")}
_NUM_BLOCKS = re.compile(r'[{,]num_gpu_blocks="(\d+)"')


_ENGINE_PREFIXES = (("kvfleet:", "kvfleet"), ("sglang:", "sglang"), ("vllm:", "vllm"))


def parse_engine_metrics(text: str) -> EngineLoad:
    """The load figures from an engine's Prometheus text (vLLM's names, or SGLang's), summed over label sets,
    and which engine exported them (kvfleet exports kvfleet:* beside vllm:*)."""
    sums: dict[str, float] = {}
    engine = "unknown"
    lora: LoRAInfo | None = None
    lora_at = -math.inf
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        end = len(line)
        for ch in "{ ":
            k = line.find(ch)
            if 0 <= k < end:
                end = k
        name = line[:end]
        if engine == "unknown" or engine == "vllm":
            for prefix, kind in _ENGINE_PREFIXES:
                if name.startswith(prefix):
                    engine = kind if engine == "unknown" or kind == "kvfleet" else engine
                    break
        if name == "vllm:lora_requests_info":  # one series per label set seen; the value is its time: latest wins
            at = _sample_value(line, end)
            if at is not None and at >= lora_at:
                lora, lora_at = _lora_info(line), at
            continue
        if name == "vllm:cache_config_info":
            bs, nb = _BLOCK_SIZE.search(line), _NUM_BLOCKS.search(line)
            if bs and nb:
                sums["kv_capacity_tokens"] = float(bs.group(1)) * float(nb.group(1))
            continue
        field = _LOAD_METRICS.get(name)
        if field is None:
            continue
        value = _sample_value(line, end)
        if value is not None:
            sums[field] = sums.get(field, 0.0) + value
    return EngineLoad(kv_usage=sums.get("kv_usage", 0.0), running=int(sums.get("running", 0)),
                      waiting=int(sums.get("waiting", 0)), prefix_queries=sums.get("prefix_queries", 0.0),
                      prefix_hits=sums.get("prefix_hits", 0.0), kv_capacity_tokens=sums.get("kv_capacity_tokens", 0.0),
                      oom_events=sums.get("oom_events", 0.0), alloc_failures=sums.get("alloc_failures", 0.0),
                      engine=engine, lora=lora, prefill_seconds=sums.get("prefill_seconds", 0.0),
                      prefill_tokens=sums.get("prefill_tokens", 0.0), pull_seconds=sums.get("pull_seconds", 0.0),
                      pulled_tokens=sums.get("pulled_tokens", 0.0))


def _sample_value(line: str, end: int) -> float | None:
    """The value of a sample line whose metric name ends at `end` (None: not a number)."""
    rest = line[line.rfind("}") + 1:] if line[end:end + 1] == "{" else line[end:]
    try:
        return float(rest.split()[0])
    except (ValueError, IndexError):
        return None


def _lora_info(line: str) -> LoRAInfo:
    found = {key: (m.group(1) if (m := rx.search(line)) else "") for key, rx in _LORA_LABELS.items()}

    def names(key: str) -> frozenset[str]:
        return frozenset(n for n in found[key].split(",") if n)

    max_lora = found["max_lora"]
    return LoRAInfo(names("running_lora_adapters"), names("waiting_lora_adapters"),
                    int(max_lora) if max_lora.isdigit() else 0)


PREFILL_RATE_TAU_S = 10.0  # the window of a replica's prefill rate (ReplicaState.prefill_rate)

@dataclass(slots=True, eq=False)
class Ticket:
    """One request this router has in flight on a replica."""

    dispatched_at: float
    tokens: int  # uncached prompt tokens (predicted)
    prefilling: bool = True  # no token streamed back yet (a non-streamed request stays so until it ends)
    ttft_features: TTFTFeatures | None = None  # the TTFT model's features when it was dispatched
    predicted_ttft_s: float | None = None  # the TTFT model's prediction then (None: the model was not ready)
    tpot_features: TPOTFeatures | None = None  # the TPOT model's features then
    predicted_tpot_s: float | None = None  # the TPOT model's prediction then (None: the model was not ready)
    first_token_at: float | None = None  # when the placement core saw its first token (the TPOT clock starts)
    due_at: float | None = None  # dispatched_at + its TTFT target, if it has one (the engine serves earliest due first)
    tpot_bound_s: float | None = None  # the step the engine keeps for its TPOT target (None: no such bound)


class ReplicaState:
    """A scrape is taken to count the requests dispatched at least `grace_s` before it was sent (they had
    time to reach the engine); later ones are this router's "new" load on top of it, and counted ones that
    finished since are subtracted, so load is neither lost nor counted twice between scrapes."""

    def __init__(self, url: str, breaker: CircuitBreaker, grace_s: float = 0.2):
        self.url = url
        self.breaker = breaker
        self.grace_s = grace_s
        self.ready: bool = False  # the last /ready check answered 200
        self.load: EngineLoad | None = None
        self.scraped_at: float = -math.inf
        self.covered_until: float = -math.inf  # requests dispatched up to here are in the scrape
        self.tickets: set[Ticket] = set()
        self.finished = 0  # covered by the last scrape, finished after it
        self.kv_events = KVEventsState.CONNECTING
        self.ready_path = "/ready"  # /health for engines without /ready (vLLM, SGLang)
        self.engine: str | None = None  # what its metrics say it is, once scraped
        self.models: frozenset[str] | None = None  # the model ids its /v1/models lists (None: not answered yet)
        self.adapters: frozenset[str] = frozenset()  # of those, the LoRA adapters (listed with a parent model)
        self._prefill_rate = 0.0  # uncached prompt tokens/s this router sent here, decayed over PREFILL_RATE_TAU_S
        self._rate_at = -math.inf

    @property
    def inflight(self) -> int:
        return len(self.tickets)

    def routable(self, now: float) -> bool:
        return self.ready and self.breaker.can_try(now)

    def load_known(self, now: float, stale_s: float) -> bool:
        return self.load is not None and now - self.scraped_at <= stale_s

    def holds(self, adapter: str) -> bool:
        """Whether the replica has the adapter: its /v1/models lists it, or its last scrape shows requests under it."""
        if adapter in (self.models or ()):
            return True
        return self.load is not None and self.load.lora is not None and adapter in self.load.lora.held

    def view(self, now: float, stale_s: float, cached_tokens: int = 0, excluded: bool = False,
             adapter: str | None = None, due_at: float | None = None) -> ReplicaView:
        """adapter: the request's LoRA adapter, if any (missing here when the replica's models do not list it).
        due_at: when the request is due, if it has a TTFT target (the view's due_ahead_tokens: the pending prefill
        due before it, with targets not yet past)."""
        known = self.load_known(now, stale_s)
        load = self.load if known and self.load is not None else EngineLoad()
        new = [t for t in self.tickets if t.dispatched_at > self.covered_until]
        pending = [t for t in self.tickets if t.prefilling]
        return ReplicaView(url=self.url, routable=not excluded and self.routable(now), load_known=known,
                           kv_usage=load.kv_usage, kv_tokens=load.kv_tokens, running=load.running,
                           waiting=load.waiting,
                           new_requests=len(new), new_tokens=sum(t.tokens for t in new), finished=self.finished,
                           inflight=len(self.tickets), pending=len(pending),
                           pending_tokens=sum(t.tokens for t in pending), cached_tokens=cached_tokens,
                           due_ahead_tokens=None if due_at is None else sum(
                               t.tokens for t in pending if t.due_at is not None and now <= t.due_at <= due_at),
                           prefill_rate=self.prefill_rate(now),
                           adapter_missing=adapter is not None and not self.holds(adapter),
                           adapter_slots_full=adapter is not None and load.lora is not None
                           and load.lora.slots_full_without(adapter))

    def on_scrape(self, load: EngineLoad, sent_at: float, now: float | None = None) -> None:
        """A scrape sent at `sent_at` (answered at `now`)."""
        self.load, self.scraped_at = load, sent_at if now is None else now
        self.covered_until = sent_at - self.grace_s
        self.finished = 0

    def on_scrape_failed(self) -> None:
        self.load = None

    def prefill_rate(self, now: float) -> float:
        """Uncached prompt tokens per second this router has been sending here (an exponentially decayed average
        over PREFILL_RATE_TAU_S): the prefill that will share the steps of a request decoding here."""
        if now <= self._rate_at:
            return self._prefill_rate
        return self._prefill_rate * math.exp(-(now - self._rate_at) / PREFILL_RATE_TAU_S)

    def on_dispatch(self, uncached_tokens: int, now: float, ttft_target_s: float | None = None) -> Ticket:
        self._prefill_rate = self.prefill_rate(now) + uncached_tokens / PREFILL_RATE_TAU_S
        self._rate_at = max(self._rate_at, now)
        ticket = Ticket(now, uncached_tokens, due_at=None if ttft_target_s is None else now + ttft_target_s)
        self.tickets.add(ticket)
        return ticket

    def on_first_token(self, ticket: Ticket) -> None:
        ticket.prefilling = False

    def on_done(self, ticket: Ticket) -> None:
        self.tickets.discard(ticket)
        if ticket.dispatched_at <= self.covered_until:  # the last scrape counted it; it is gone now
            self.finished += 1

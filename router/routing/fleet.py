"""The fleet as this router sees it: the replicas from discovery, grouped in pools, their background checks
(/ready, /metrics, KV events), and `lease()` - the per-request decision inside one pool, handed to the proxy
as a Lease. The decision and its bookkeeping are the placement core's (placement.py: both prefix indexes,
replica views, `policy.choose`, what was routed); this file is its HTTP edge. A replica belongs to one pool;
prefix-cache affinity and session hashing stay inside a pool."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from contract.slo import TPOT_HEADER, TTFT_HEADER
from router.config import RouterConfig, VllmEventsConfig
from router.metrics import RouterMetrics
from router.refusal import Refusal, refuse
from router.routing.kv_events import KVEventSubscriber
from router.routing.lease import Lease
from router.routing.placement import DEFAULT_POOL, Placement, PlacementConfig
from router.routing.policies import POLICIES, Decision
from router.routing.prepare import PreparedRequest
from router.routing.replicas import EngineLoad, ReplicaState, Ticket, parse_engine_metrics
from router.states import KVEventsState

log = logging.getLogger("kvfleet.router.fleet")

__all__ = ["DEFAULT_POOL", "Fleet", "PoolEngine"]

MODELS_INTERVAL_S = 5.0  # how often a ready replica's /v1/models is asked again (adapters come and go)
KV_EVENTS_WARN_HEARTBEATS = 3  # ready this many --kv-heartbeat-timeout without a live KV event stream: a warning


@dataclass(frozen=True)
class PoolEngine:
    """What a pool's replicas are: `kind` (router/config.py ENGINE_TYPES) decides readiness and the KV event
    source; `kv_events` where vLLM / SGLang publish theirs (None: the --vllm-kv-events flags)."""

    kind: str = "auto"
    kv_events: VllmEventsConfig | None = None


TPOT_SAMPLE_INTERVAL_S = 0.05  # at most 20 streams a second followed for the TPOT model alone

class Fleet:
    def __init__(self, cfg: RouterConfig, metrics: RouterMetrics, clock=time.monotonic):
        self.cfg = cfg
        self.metrics = metrics
        self.clock = clock
        self.policy = POLICIES[cfg.policy]
        self.placement = Placement(self.policy, PlacementConfig(
            cfg.scoring, cfg.block_size, cfg.hash_seed, cfg.approx_max_blocks, cfg.scrape_stale_s,
            breaker_failures=cfg.breaker_failures, breaker_open_s=cfg.breaker_open_s))
        self._tasks: dict[str, list[asyncio.Task]] = {}
        self._subscribers: dict[str, KVEventSubscriber] = {}  # kvfleet engines' KV event streams, by replica
        self._client: httpx.AsyncClient | None = None
        self.changed = asyncio.Event()  # set whenever readiness, membership or models change (tests, `kvfleet up`)
        self.listeners: list[Callable[[], None]] = []  # called on the same changes (the pools' model catalog)
        self.engines: dict[str, PoolEngine] = {}  # pool -> its engine kind (absent: the --engine-type flags)
        # the placement core's state, under the names the rest of the router reads (the same objects)
        p = self.placement
        self.replicas, self.members, self.pool_of, self.rings = p.replicas, p.members, p.pool_of, p.rings
        self.index, self.approx = p.index, p.approx
        self._tpot_sampled_at = -math.inf

    def sample_tpot(self) -> bool:
        """Whether a stream that needs no usage otherwise should be followed for the TPOT model: one stream per
        TPOT_SAMPLE_INTERVAL_S at most (every stream at a few per second; ~2% of them at 1,000/s, where reading
        every usage chunk would cost a fifth of the router's streamed throughput)."""
        now = self.clock()
        if now - self._tpot_sampled_at < TPOT_SAMPLE_INTERVAL_S:
            return False
        self._tpot_sampled_at = now
        return True

    # -- membership ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        # the internal token goes with every check (/ready, /metrics, KV events): engines started with
        # --require-internal-token answer 401 to anything else but /health and /ready
        token = self.cfg.internal_token
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(2.0), limits=httpx.Limits(max_keepalive_connections=64),
                                         headers={"authorization": f"Bearer {token}"} if token else None)

    async def stop(self) -> None:
        for url in list(self.replicas):
            await self._stop_checks(url)
            self.placement.remove(url)
        if self._client is not None:
            await self._client.aclose()

    async def set_replicas(self, urls, pool: str = DEFAULT_POOL) -> None:
        """A pool's current list from its discovery: new replicas join, missing ones leave (their in-flight
        requests finish). A URL that another pool already holds stays there (logged)."""
        change = self.placement.set_members(pool, (u.rstrip("/") for u in urls))
        for url in change.elsewhere:
            owner = self.pool_of[url]
            log.warning("replica %s is listed by pools %s and %s; it stays in %s", url, owner, pool, owner)
        for url in change.left:
            log.info("replica left pool %s: %s", pool, url)
            await self._stop_checks(url)
        for url in change.joined:
            log.info("replica joined pool %s: %s", pool, url)
            self._start_checks(self.replicas[url])
        self._notify()

    async def drop_pool(self, pool: str) -> None:
        """A pool left the configuration: its replicas leave."""
        await self.set_replicas([], pool)
        self.placement.drop_pool(pool)

    @property
    def client(self) -> httpx.AsyncClient:
        """The HTTP client of the background checks (made by `start()`)."""
        if self._client is None:
            raise RuntimeError("Fleet.start() was not called")
        return self._client

    def engine_of(self, pool: str) -> PoolEngine:
        """The pool's engine settings: its own (pools file), else the --engine-type / --vllm-kv-events flags'."""
        own = self.engines.get(pool)
        kind = own.kind if own is not None and own.kind != "auto" else self.cfg.engine_type
        return PoolEngine(kind, self.kv_events_of(pool))

    def kv_events_of(self, pool: str) -> VllmEventsConfig:
        """Where the pool's vLLM / SGLang replicas publish KV events: its own setting, else the flags'."""
        own = self.engines.get(pool)
        return own.kv_events if own is not None and own.kv_events is not None else self.cfg.vllm_events

    def _start_checks(self, st: ReplicaState) -> None:
        cfg, url = self.cfg, st.url
        pool = self.pool_of.get(url, DEFAULT_POOL)
        engine = self.engine_of(pool)
        if engine.kind in ("vllm", "sglang"):  # declared: no /ready, no kvfleet KV event stream to probe
            st.ready_path = "/health"
            st.kv_events = KVEventsState.UNAVAILABLE
        tasks = [asyncio.create_task(self._health_loop(st)), asyncio.create_task(self._scrape_loop(st))]
        vllm_events = self.kv_events_of(pool).endpoints(url)

        def on_status(s, url=url):
            self.placement.on_kv_events(url, KVEventsState(s))

        def on_resync(reason, url=url):
            self.metrics.kv_resyncs.labels(url, reason).inc()

        if self.policy.needs.kv_events and vllm_events is not None:  # vLLM's own KV events, over ZMQ
            from router.routing.vllm_kv_events import VllmKVSubscriber

            st.kv_events = KVEventsState.CONNECTING
            sub = VllmKVSubscriber(url, vllm_events[0], vllm_events[1], self.index, cfg.hash_seed,
                                   on_status=on_status, on_resync=on_resync)
            tasks.append(asyncio.create_task(sub.run()))
        elif self.policy.needs.kv_events and engine.kind in ("auto", "kvfleet"):
            events = KVEventSubscriber(url, self.index, self.client, cfg.kv_heartbeat_timeout_s, cfg.internal_token,
                                       on_status=on_status, on_resync=on_resync)
            self._subscribers[url] = events
            tasks.append(asyncio.create_task(events.run()))
        self._tasks[url] = tasks

    async def _stop_checks(self, url: str) -> None:
        self._subscribers.pop(url, None)
        tasks = self._tasks.pop(url, [])
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()
        for listener in self.listeners:
            listener()

    # -- background checks ---------------------------------------------------------------------------------
    async def _health_loop(self, st: ReplicaState) -> None:
        models_at = -float("inf")
        ready_since: float | None = None
        warned = False
        while True:
            try:
                timeout = min(2.0, self.cfg.health_interval_s * 2)
                resp = await self.client.get(st.url + st.ready_path, timeout=timeout)
                if resp.status_code == 404 and st.ready_path == "/ready":  # vLLM, SGLang: ready once serving
                    st.ready_path = "/health"
                    log.info("replica %s has no /ready: its readiness is /health", st.url)
                    resp = await self.client.get(st.url + st.ready_path, timeout=timeout)
                ready = resp.status_code == 200
            except httpx.HTTPError:
                ready = False
            # a replica turning ready lists its models first: readiness and what it serves change together, with
            # no await between them (else /ready could say 200 while the catalog, and so the tokenizer fetch and
            # the wait for it, know nothing of the replica's models yet)
            models_changed = False
            if ready and (not st.ready or st.models is None or self.clock() - models_at >= MODELS_INTERVAL_S):
                models_at = self.clock()
                models_changed = await self._models(st)
            changed = self.placement.on_health(st.url, ready, self.clock())
            if changed:
                log.info("replica %s is %s", st.url, "ready" if ready else "NOT ready")
                if ready and (sub := self._subscribers.get(st.url)) is not None and sub.status != "live":
                    sub.wake()  # its KV event stream, refused while it loaded, is there now
            changed = changed or models_changed
            if changed:
                self._notify()
            now = self.clock()
            ready_since = (ready_since or now) if ready else None
            if ready_since is not None and now - ready_since >= KV_EVENTS_WARN_HEARTBEATS * self.cfg.kv_heartbeat_timeout_s \
                    and st.kv_events is KVEventsState.CONNECTING and not warned:
                warned = True  # once per replica: a misplaced endpoint stays misplaced
                where = self.kv_events_of(self.pool_of.get(st.url, DEFAULT_POOL)).endpoints(st.url)
                log.warning("replica %s has been ready for %.0f s but its KV event stream is not live (%s): the "
                            "exact index knows nothing of its cache", st.url, now - ready_since,
                            f"ZMQ {where[0]}: is the engine publishing there? vLLM binds a tcp:// publisher only "
                            "for tcp://*:PORT, ipc:// always" if where else "GET /v1/kv/events")
            await asyncio.sleep(self.cfg.health_interval_s)

    async def _models(self, st: ReplicaState) -> bool:
        """Ask the replica which models it serves (/v1/models); True when that changed."""
        try:
            resp = await self.client.get(st.url + "/v1/models", timeout=2.0)
            data = resp.json().get("data") if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return False  # unknown this time: what it listed before stays
        listed = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)] \
            if isinstance(data, list) else []
        ids = frozenset(m["id"] for m in listed) if isinstance(data, list) else None
        adapters = frozenset(m["id"] for m in listed if m.get("parent"))  # LoRA adapters (kvfleet's and vLLM's)
        if not self.placement.on_models(st.url, ids or None, adapters):
            return False
        log.info("replica %s serves %s", st.url, ", ".join(sorted(ids)) if ids else "no listed model")
        return True

    def seats(self, pool: str, slots: int) -> int:
        """All the requests the pool's routable replicas take, `slots` each."""
        return slots * len(self.ready_urls(pool))

    def room(self, pool: str, slots: int) -> int:
        """Requests the pool's replicas can take now, `slots` each (router/admission/gate.py)."""
        return self.placement.room(pool, self.clock(), slots, self.cfg.scoring.overload_kv_usage)

    def learned_models(self) -> dict[str, frozenset[str]]:
        """Per pool, the models its replicas list (router/pools/models.py decides what they serve)."""
        return self.placement.learned_models()

    def learned_adapters(self) -> dict[str, frozenset[str]]:
        """Per pool, the LoRA adapters its replicas list (served with the pool's declared models)."""
        return self.placement.learned_adapters()

    def not_serving(self, pool: str, model: str) -> frozenset[str]:
        """The pool's replicas that list their models, without this one."""
        return self.placement.not_serving(pool, model)

    async def _scrape_loop(self, st: ReplicaState) -> None:
        while True:
            try:
                sent_at = self.clock()
                resp = await self.client.get(st.url + "/metrics", timeout=min(2.0, self.cfg.scrape_stale_s))
                if resp.status_code == 200:
                    load = parse_engine_metrics(resp.text)
                    if load.engine != st.engine:
                        st.engine = load.engine
                        log.info("replica %s is a %s engine (by the metric names it exports)", st.url, load.engine)
                    self.placement.on_load(st.url, load, sent_at, self.clock())
                else:
                    self.placement.on_load_failed(st.url)
            except httpx.HTTPError:
                self.placement.on_load_failed(st.url)
            await asyncio.sleep(self.cfg.scrape_interval_s)

    # -- routing -------------------------------------------------------------------------------------------
    def ready_urls(self, pool: str | None = None) -> list[str]:
        """Routable replicas, of one pool or (None) of all."""
        return self.placement.ready_urls(self.clock(), pool)

    def fresh_loads(self, pool: str | None = None) -> dict[str, EngineLoad]:
        """The scraped load of each routable replica (of one pool, or all) whose scrape is fresh."""
        return self.placement.fresh_loads(self.clock(), pool)

    def load(self, pool: str | None = None) -> tuple[float | None, float | None]:
        """Mean KV usage and waiting requests per routable replica whose scraped load is fresh (None, None
        when none is): the fleet's (or one pool's) pressure, for load shedding."""
        loads = list(self.fresh_loads(pool).values())
        if not loads:
            return None, None
        return sum(x.kv_usage for x in loads) / len(loads), sum(x.waiting for x in loads) / len(loads)

    def predict_cached(self, prep: PreparedRequest, urls: list[str]) -> dict[str, int]:
        """Per replica, the prompt tokens its prefix cache holds (exact index, or approximate fallback)."""
        return self.placement.predict_cached(prep, urls)

    def route(self, prep: PreparedRequest, excluded: set[str] | frozenset[str] = frozenset(),
              pool: str = DEFAULT_POOL, candidates: Sequence[str] | None = None, peek: bool = False) -> Decision | None:
        return self.placement.choose(prep, self.clock(), pool, excluded, candidates, peek)

    def slo_refusal(self, prep: PreparedRequest, pool: str, best_effort: bool = False) -> Refusal | None:
        """429 `slo_unattainable` (with Retry-After) when no routable replica of `pool` is predicted to send the
        request's first token within its TTFT target, or its later tokens within its TPOT target; None when one
        is, when it has no target, or while the model for that target is not ready (no prediction: no refusal).
        `best_effort` (the pool's `slo_unattainable: best_effort`): None instead of the 429, the request marked
        best effort (served behind the pool's other requests)."""
        miss = self.placement.unattainable(prep, self.clock(), pool)
        if miss is None:
            return None
        if best_effort:
            self.metrics.slo_best_effort.labels(pool).inc()
            prep.best_effort = True
            return None
        self.metrics.slo_refused.labels(pool).inc()
        ttft = miss.which == "ttft"
        header, what = (TTFT_HEADER, "send the first token") if ttft else (TPOT_HEADER, "send each later token")
        # a first token late by d seconds: the fleet needs about d to catch up; a slow token rate: a second
        wait = max(1, math.ceil(miss.best_s - miss.target_s)) if ttft else 1
        return refuse(429, f"no replica of pool {pool!r} is predicted to {what} within {miss.target_s * 1000:.0f} "
                           f"ms (the best predicts {miss.best_s * 1000:.0f} ms); retry later, or with a longer "
                           f"{header}", "slo_unattainable", header, "slo_unattainable",
                      [(b"retry-after", str(wait).encode())])

    def lease(self, prep: PreparedRequest, excluded: set[str] | frozenset[str] = frozenset(),
              pool: str = DEFAULT_POOL, candidates: Sequence[str] | None = None) -> Lease | None:
        """Route the request inside `pool` (among `candidates` only, when given) and dispatch it to the chosen
        replica; None when no routable replica of the pool is left."""
        decision = self.route(prep, excluded, pool, candidates)
        if decision is None:
            return None
        ticket = self.placement.on_routed(decision.url, prep, decision.predicted_cached_tokens, self.clock(),
                                          decision.pull_from, decision.prefill)
        if ticket is None:  # not a known replica (the policy chooses among them): nothing to lease
            return None
        return Lease(decision, self.replicas[decision.url], ticket, self.clock, self._first_token_of(decision.url),
                     self._decoded)

    def _first_token_of(self, url: str):
        def first_token(ticket: Ticket) -> None:
            seconds = self.placement.on_first_token(url, ticket, self.clock())
            m = self.metrics
            _score(seconds, ticket.predicted_ttft_s, m.ttft_error, m.ttft_relative_error, m.ttft_predicted)

        return first_token

    def _decoded(self, ticket: Ticket, output_tokens: int) -> None:
        seconds = self.placement.on_decoded(ticket, output_tokens, self.clock())
        m = self.metrics
        _score(seconds, ticket.predicted_tpot_s, m.tpot_error, m.tpot_relative_error, m.tpot_predicted)


def _score(observed: float | None, predicted: float | None, error, relative, count) -> None:
    """A latency model's prediction against what was observed: signed and relative error, and the count."""
    if observed is None or predicted is None:
        return
    error.observe(observed - predicted)
    if observed > 0:
        relative.observe(abs(observed - predicted) / observed)
    count.inc()

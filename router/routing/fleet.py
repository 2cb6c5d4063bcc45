"""The fleet as this router sees it: the replicas from discovery, grouped in pools, their background checks
(/ready, /metrics, KV events), both prefix indexes, and `lease()` - the per-request decision inside one pool
(no I/O on that path), handed to the proxy as a Lease. A replica belongs to one pool; prefix-cache affinity
and session hashing stay inside a pool."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import httpx

from router.admission.prepare import PreparedRequest
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.routing.approx_index import ApproxPrefixIndex
from router.routing.kv_events import KVEventSubscriber
from router.routing.lease import Lease
from router.routing.policies import POLICIES, Decision, HashRing, IndexKind, RouteRequest
from router.routing.prefix_index import PrefixIndex
from router.routing.replicas import CircuitBreaker, EngineLoad, ReplicaState, parse_engine_metrics
from router.routing.states import CircuitState, KVEventsState

log = logging.getLogger("kvfleet.router.fleet")

DEFAULT_POOL = "default"  # the one pool of a router started without --pools


class Fleet:
    def __init__(self, cfg: RouterConfig, metrics: RouterMetrics, clock=time.monotonic):
        self.cfg = cfg
        self.metrics = metrics
        self.clock = clock
        self.policy = POLICIES[cfg.policy]
        self.replicas: dict[str, ReplicaState] = {}
        self.index = PrefixIndex()
        self.approx = ApproxPrefixIndex(cfg.approx_max_blocks)
        self.members: dict[str, list[str]] = {}  # pool -> its replica URLs
        self.pool_of: dict[str, str] = {}  # replica URL -> pool
        self.rings: dict[str, HashRing] = {}
        self._turn = 0  # advanced once per decision: rotates ties (and round-robin)
        self._tasks: dict[str, list[asyncio.Task]] = {}
        self._client: httpx.AsyncClient | None = None
        self.changed = asyncio.Event()  # set whenever readiness or membership changes (tests, `kvfleet up`)

    # -- membership ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        # the internal token goes with every check (/ready, /metrics, KV events): engines started with
        # --require-internal-token answer 401 to anything else but /health and /ready
        token = self.cfg.internal_token
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(2.0), limits=httpx.Limits(max_keepalive_connections=64),
                                         headers={"authorization": f"Bearer {token}"} if token else None)

    async def stop(self) -> None:
        for url in list(self.replicas):
            await self._remove(url)
        if self._client is not None:
            await self._client.aclose()

    async def set_replicas(self, urls, pool: str = DEFAULT_POOL) -> None:
        """A pool's current list from its discovery: new replicas join, missing ones leave (their in-flight
        requests finish). A URL that another pool already holds stays there (logged)."""
        wanted = []
        for u in dict.fromkeys(u.rstrip("/") for u in urls):
            owner = self.pool_of.get(u, pool)
            if owner != pool:
                log.warning("replica %s is listed by pools %s and %s; it stays in %s", u, owner, pool, owner)
            else:
                wanted.append(u)
        for url in [u for u in self.members.get(pool, []) if u not in wanted]:
            log.info("replica left pool %s: %s", pool, url)
            await self._remove(url)
        for url in wanted:
            if url not in self.replicas:
                log.info("replica joined pool %s: %s", pool, url)
                self._add(url, pool)
        self.members[pool] = wanted
        self.rings[pool] = HashRing(wanted, self.cfg.scoring.session_vnodes)
        self._notify()

    async def drop_pool(self, pool: str) -> None:
        """A pool left the configuration: its replicas leave."""
        await self.set_replicas([], pool)
        self.members.pop(pool, None)
        self.rings.pop(pool, None)

    def _add(self, url: str, pool: str) -> None:
        cfg = self.cfg
        self.pool_of[url] = pool
        st = self.replicas[url] = ReplicaState(url, CircuitBreaker(cfg.breaker_failures, cfg.breaker_open_s))
        if cfg.engine_type in ("vllm", "sglang"):  # declared: no /ready, no kvfleet KV event stream to probe
            st.ready_path = "/health"
            st.kv_events = KVEventsState.UNAVAILABLE
        tasks = [asyncio.create_task(self._health_loop(st)), asyncio.create_task(self._scrape_loop(st))]
        vllm_events = cfg.vllm_events.endpoints(url)
        if self.policy.needs.kv_events and vllm_events is not None:  # vLLM's own KV events, over ZMQ
            from router.routing.vllm_kv_events import VllmKVSubscriber

            st.kv_events = KVEventsState.CONNECTING
            sub = VllmKVSubscriber(url, vllm_events[0], vllm_events[1], self.index, cfg.hash_seed,
                                   on_status=lambda s, st=st: setattr(st, "kv_events", KVEventsState(s)),
                                   on_resync=lambda reason, u=url: self.metrics.kv_resyncs.labels(u, reason).inc())
            tasks.append(asyncio.create_task(sub.run()))
        elif self.policy.needs.kv_events and cfg.engine_type in ("auto", "kvfleet"):
            sub = KVEventSubscriber(url, self.index, self._client, cfg.kv_heartbeat_timeout_s, cfg.internal_token,
                                    on_status=lambda s, st=st: setattr(st, "kv_events", KVEventsState(s)),
                                    on_resync=lambda reason, u=url: self.metrics.kv_resyncs.labels(u, reason).inc())
            tasks.append(asyncio.create_task(sub.run()))
        self._tasks[url] = tasks

    async def _remove(self, url: str) -> None:
        tasks = self._tasks.pop(url, [])
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self.replicas.pop(url, None)
        self.pool_of.pop(url, None)
        if self.index.has(url):
            self.index.drop(url)
        self.approx.drop(url)

    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    # -- background checks ---------------------------------------------------------------------------------
    async def _health_loop(self, st: ReplicaState) -> None:
        while True:
            try:
                timeout = min(2.0, self.cfg.health_interval_s * 2)
                resp = await self._client.get(st.url + st.ready_path, timeout=timeout)
                if resp.status_code == 404 and st.ready_path == "/ready":  # vLLM, SGLang: ready once serving
                    st.ready_path = "/health"
                    log.info("replica %s has no /ready: its readiness is /health", st.url)
                    resp = await self._client.get(st.url + st.ready_path, timeout=timeout)
                ready = resp.status_code == 200
            except httpx.HTTPError:
                ready = False
            if ready != st.ready:
                log.info("replica %s is %s", st.url, "ready" if ready else "NOT ready")
                st.ready = ready
                if ready and st.breaker.state(self.clock()) is not CircuitState.CLOSED:
                    st.breaker.on_success()  # it came back: give it traffic again at once
                self._notify()
            await asyncio.sleep(self.cfg.health_interval_s)

    async def _scrape_loop(self, st: ReplicaState) -> None:
        while True:
            try:
                sent_at = self.clock()
                resp = await self._client.get(st.url + "/metrics", timeout=min(2.0, self.cfg.scrape_stale_s))
                if resp.status_code == 200:
                    load = parse_engine_metrics(resp.text)
                    if load.engine != st.engine:
                        st.engine = load.engine
                        log.info("replica %s is a %s engine (by the metric names it exports)", st.url, load.engine)
                    st.on_scrape(load, sent_at, self.clock())
                else:
                    st.on_scrape_failed()
            except httpx.HTTPError:
                st.on_scrape_failed()
            await asyncio.sleep(self.cfg.scrape_interval_s)

    # -- routing -------------------------------------------------------------------------------------------
    def _urls(self, pool: str | None) -> list[str]:
        return list(self.replicas) if pool is None else self.members.get(pool, [])

    def ready_urls(self, pool: str | None = None) -> list[str]:
        """Routable replicas, of one pool or (None) of all."""
        now = self.clock()
        return [u for u in self._urls(pool) if self.replicas[u].routable(now)]

    def fresh_loads(self, pool: str | None = None) -> dict[str, EngineLoad]:
        """The scraped load of each routable replica (of one pool, or all) whose scrape is fresh."""
        now = self.clock()
        out = {}
        for u in self._urls(pool):
            st = self.replicas[u]
            if st.routable(now) and st.load_known(now, self.cfg.scrape_stale_s) and st.load is not None:
                out[u] = st.load
        return out

    def load(self, pool: str | None = None) -> tuple[float | None, float | None]:
        """Mean KV usage and waiting requests per routable replica whose scraped load is fresh (None, None
        when none is): the fleet's (or one pool's) pressure, for load shedding."""
        loads = list(self.fresh_loads(pool).values())
        if not loads:
            return None, None
        return sum(x.kv_usage for x in loads) / len(loads), sum(x.waiting for x in loads) / len(loads)

    def predict_cached(self, prep: PreparedRequest, urls: list[str]) -> dict[str, int]:
        """Per replica, the prompt tokens its prefix cache holds (exact index, or approximate fallback)."""
        if prep.token_ids is None or not urls:
            return {}
        cfg, needs = self.cfg, self.policy.needs
        out: dict[str, int] = {}
        approx_urls: list[str] = []
        groups: dict[tuple[int, int], list[str]] = {}
        for u in urls:
            kind = needs.index_for(self.replicas[u].kv_events)
            if kind is IndexKind.APPROX:
                approx_urls.append(u)
            elif kind is IndexKind.EXACT and (params := self.index.params.get(u)) is not None:
                groups.setdefault(params, []).append(u)
        for (bs, seed), members in groups.items():
            for u, n in self.index.matched_blocks(prep.block_hashes(bs, seed), members).items():
                out[u] = n * bs
        if approx_urls:
            hashes = prep.block_hashes(cfg.block_size, cfg.hash_seed)
            for u, n in self.approx.matched_blocks(hashes, approx_urls).items():
                out[u] = n * cfg.block_size
        return out

    def route(self, prep: PreparedRequest, excluded: set[str] | frozenset[str] = frozenset(),
              pool: str = DEFAULT_POOL) -> Decision | None:
        cfg, now = self.cfg, self.clock()
        urls = self.members.get(pool, [])
        ring = self.rings.get(pool)
        if not urls or ring is None:
            return None
        cached = self.predict_cached(prep, urls)
        views = [self.replicas[u].view(now, cfg.scrape_stale_s, cached.get(u, 0), u in excluded) for u in urls]
        self._turn += 1
        return self.policy.choose(views, RouteRequest(prep.num_prompt_tokens, prep.session_key), cfg.scoring,
                                  ring, self._turn - 1)

    def lease(self, prep: PreparedRequest, excluded: set[str] | frozenset[str] = frozenset(),
              pool: str = DEFAULT_POOL) -> Lease | None:
        """Route the request inside `pool` and dispatch it to the chosen replica; None when no routable
        replica of the pool is left."""
        decision = self.route(prep, excluded, pool)
        if decision is None:
            return None
        cfg, st, now = self.cfg, self.replicas[decision.url], self.clock()
        ticket = st.on_dispatch(max(prep.num_prompt_tokens - decision.predicted_cached_tokens, 0), now)
        st.breaker.on_attempt(now)
        if prep.token_ids is not None and self.policy.needs.index_for(st.kv_events) is IndexKind.APPROX:
            self.approx.record(st.url, prep.block_hashes(cfg.block_size, cfg.hash_seed))  # where it went
        return Lease(decision, st, ticket, self.clock)

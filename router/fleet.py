"""The fleet as this router sees it: the replicas from discovery, their background checks (/ready, /metrics,
KV events), both prefix indexes, and `route()` - the per-request decision (no I/O on that path)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import httpx

from router.approx_index import ApproxPrefixIndex
from router.config import RouterConfig
from router.kv_events import KVEventSubscriber
from router.metrics import RouterMetrics
from router.policy import (
    Decision,
    HashRing,
    RouteRequest,
    choose_by_cache,
    choose_least_load,
    choose_round_robin,
    choose_session,
)
from router.prefix_index import PrefixIndex
from router.prepare import PreparedRequest
from router.replicas import CircuitBreaker, ReplicaState, parse_engine_metrics

log = logging.getLogger("kvfleet.router.fleet")


class Fleet:
    def __init__(self, cfg: RouterConfig, metrics: RouterMetrics, clock=time.monotonic):
        self.cfg = cfg
        self.metrics = metrics
        self.clock = clock
        self.replicas: dict[str, ReplicaState] = {}
        self.index = PrefixIndex()
        self.approx = ApproxPrefixIndex(cfg.approx_max_blocks)
        self.ring = HashRing([], cfg.scoring.session_vnodes)
        self._rr = 0
        self._tasks: dict[str, list[asyncio.Task]] = {}
        self._client: httpx.AsyncClient | None = None
        self.changed = asyncio.Event()  # set whenever readiness or membership changes (tests, `kvfleet up`)

    # -- membership ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(2.0), limits=httpx.Limits(max_keepalive_connections=64))

    async def stop(self) -> None:
        for url in list(self.replicas):
            await self._remove(url)
        if self._client is not None:
            await self._client.aclose()

    async def set_replicas(self, urls) -> None:
        """Discovery's current list: new replicas join, missing ones leave (their in-flight requests finish)."""
        wanted = list(dict.fromkeys(u.rstrip("/") for u in urls))
        for url in [u for u in self.replicas if u not in wanted]:
            log.info("replica left: %s", url)
            await self._remove(url)
        for url in wanted:
            if url not in self.replicas:
                log.info("replica joined: %s", url)
                self._add(url)
        self.ring = HashRing(list(self.replicas), self.cfg.scoring.session_vnodes)
        self._notify()

    def _add(self, url: str) -> None:
        cfg = self.cfg
        st = self.replicas[url] = ReplicaState(url, CircuitBreaker(cfg.breaker_failures, cfg.breaker_open_s))
        tasks = [asyncio.create_task(self._health_loop(st)), asyncio.create_task(self._scrape_loop(st))]
        if cfg.policy == "kv":
            sub = KVEventSubscriber(url, self.index, self._client, cfg.kv_heartbeat_timeout_s, cfg.internal_token,
                                    on_status=lambda s, st=st: setattr(st, "kv_events", s),
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
                resp = await self._client.get(st.url + "/ready", timeout=min(2.0, self.cfg.health_interval_s * 2))
                ready = resp.status_code == 200
            except httpx.HTTPError:
                ready = False
            if ready != st.ready:
                log.info("replica %s is %s", st.url, "ready" if ready else "NOT ready")
                st.ready = ready
                if ready and st.breaker.state(self.clock()) != "closed":
                    st.breaker.on_success()  # it came back: give it traffic again at once
                self._notify()
            await asyncio.sleep(self.cfg.health_interval_s)

    async def _scrape_loop(self, st: ReplicaState) -> None:
        while True:
            try:
                sent_at = self.clock()
                resp = await self._client.get(st.url + "/metrics", timeout=min(2.0, self.cfg.scrape_stale_s))
                if resp.status_code == 200:
                    st.on_scrape(parse_engine_metrics(resp.text), sent_at, self.clock())
                else:
                    st.on_scrape_failed()
            except httpx.HTTPError:
                st.on_scrape_failed()
            await asyncio.sleep(self.cfg.scrape_interval_s)

    # -- routing -------------------------------------------------------------------------------------------
    def ready_urls(self) -> list[str]:
        now = self.clock()
        return [u for u, st in self.replicas.items() if st.routable(now)]

    def predict_cached(self, prep: PreparedRequest, urls: list[str]) -> dict[str, int]:
        """Per replica, the prompt tokens its prefix cache holds (exact index, or approximate fallback)."""
        if prep.token_ids is None or not urls:
            return {}
        cfg = self.cfg
        out: dict[str, int] = {}
        if cfg.policy == "approx-prefix":
            approx_urls = urls
        else:
            approx_urls = [u for u in urls if self.replicas[u].kv_events == "unavailable"]
            groups: dict[tuple[int, int], list[str]] = {}
            for u in urls:
                params = self.index.params.get(u)
                if params is not None and self.replicas[u].kv_events == "live":
                    groups.setdefault(params, []).append(u)
            for (bs, seed), members in groups.items():
                for u, n in self.index.matched_blocks(prep.block_hashes(bs, seed), members).items():
                    out[u] = n * bs
        if approx_urls:
            hashes = prep.block_hashes(cfg.block_size, cfg.hash_seed)
            for u, n in self.approx.matched_blocks(hashes, approx_urls).items():
                out[u] = n * cfg.block_size
        return out

    def route(self, prep: PreparedRequest, excluded: set[str] | frozenset[str] = frozenset()) -> Decision | None:
        cfg, now = self.cfg, self.clock()
        urls = list(self.replicas)
        cached = self.predict_cached(prep, urls) if cfg.policy in ("kv", "approx-prefix") else {}
        views = [self.replicas[u].view(now, cfg.scrape_stale_s, cached.get(u, 0), u in excluded) for u in urls]
        req = RouteRequest(prep.num_prompt_tokens, prep.session_key)
        self._rr += 1
        turn = self._rr - 1  # rotates ties (and round-robin)
        if cfg.policy in ("kv", "approx-prefix"):
            return choose_by_cache(views, req, cfg.scoring, self.ring, turn)
        if cfg.policy == "session":
            return choose_session(views, req, cfg.scoring, self.ring, turn)
        if cfg.policy == "least-load":
            return choose_least_load(views, req, cfg.scoring, turn)
        return choose_round_robin(views, req, cfg.scoring, turn)

    def record_routed(self, url: str, prep: PreparedRequest) -> None:
        """Remember where the request went, for the approximate index."""
        st = self.replicas.get(url)
        if prep.token_ids is None or st is None:
            return
        if self.cfg.policy == "approx-prefix" or (self.cfg.policy == "kv" and st.kv_events == "unavailable"):
            self.approx.record(url, prep.block_hashes(self.cfg.block_size, self.cfg.hash_seed))

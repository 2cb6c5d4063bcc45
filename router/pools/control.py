"""The router's live engine pools: the configuration in force (the pools file, reloaded on change, or the one
`default` pool of the discovery flags), one discovery task per pool feeding the fleet, each pool's signal
window and degradation state, and the pools as requests see them after degradation.

Every `interval_s` each pool's signals (router/pools/signals.py) go through the state machine
(router/pools/degradation.py); a level change is logged and counted, and the pool's effective spec (weight,
max_tokens default and cap) and shedding follow the new level at once. A reload that changes a pool's
version or weight starts its degradation afresh (a rolled-back canary gets traffic again only so); a
changed discovery source restarts that pool's discovery.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from dataclasses import dataclass, field

from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.pools.choice import PoolChoice, PoolRefusal, PoolSpec, choose_pool
from router.pools.degradation import LEVELS, Level, State, actions, degraded, step
from router.pools.file import PoolConfig, PoolsConfig, PoolsFile
from router.pools.models import ModelCatalog, catalog
from router.pools.signals import SignalWindow
from router.pools.sizing import DemandWindow, Served, desired
from router.routing.discovery import flag_source, make_discovery
from router.routing.fleet import DEFAULT_POOL, Fleet, PoolEngine

log = logging.getLogger("kvfleet.router.pools")


@dataclass
class LivePool:
    config: PoolConfig
    state: State
    window: SignalWindow
    effective: PoolSpec
    shed: bool = False
    discovery: asyncio.Task | None = None
    demand: DemandWindow = field(default_factory=DemandWindow)  # what its requests with targets need (sizing.py)


@dataclass(frozen=True)
class PoolStatus:
    name: str
    version: str
    weight: int
    effective_weight: int
    level: Level
    replicas: int
    ready: int
    desired: int = 0  # the replicas its requests' latency targets need (router/pools/sizing.py)

    @property
    def level_index(self) -> int:
        return LEVELS.index(self.level)


def default_pools(cfg: RouterConfig) -> PoolsConfig:
    """The one pool of a router without --pools: every replica of the discovery flags, no limits."""
    return PoolsConfig((PoolConfig(PoolSpec(DEFAULT_POOL, "default", 1), flag_source(cfg)),))


class Pools:
    def __init__(self, cfg: RouterConfig, fleet: Fleet, metrics: RouterMetrics, clock=time.monotonic,
                 rng: random.Random | None = None):
        """A bad pools file raises here (ConfigFileError naming the line), before the router serves."""
        self.cfg, self.fleet, self.metrics, self.clock = cfg, fleet, metrics, clock
        self.rng = rng or random.Random()
        self.file = PoolsFile(cfg.pools_file, on_reload=metrics.pools_reloaded) if cfg.pools_file else None
        self.config = self.file.value if self.file else default_pools(cfg)
        self.live: dict[str, LivePool] = {}
        self._order: list[PoolSpec] = []  # effective specs in file order, for choose_pool
        self._of_model: dict[str, list[PoolSpec]] = {}  # the same, per model (the pools that serve it)
        self.catalog = ModelCatalog({}, ())
        self.catalog_listeners: list = []  # called after the catalog changed
        self._tasks: list[asyncio.Task] = []
        fleet.listeners.append(self._recatalog)
        metrics.attach_pools(self)

    # -- lifecycle -----------------------------------------------------------------------------------------
    async def start(self) -> None:
        await self._apply(self.config)
        self._tasks.append(asyncio.create_task(self._control_loop()))
        if self.file is not None:
            self._tasks.append(asyncio.create_task(self.file.watch(self._reloaded)))

    async def stop(self) -> None:
        tasks = self._tasks + [p.discovery for p in self.live.values() if p.discovery is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    def _reloaded(self, config: PoolsConfig) -> None:
        self._tasks.append(asyncio.create_task(self._apply(config)))
        self._tasks = [t for t in self._tasks if not t.done()]

    async def _apply(self, config: PoolsConfig) -> None:
        self.config = config
        d = config.degradation
        wanted = {p.spec.name: p for p in config.pools}
        for name in [n for n in self.live if n not in wanted]:
            gone = self.live.pop(name)
            if gone.discovery is not None:
                gone.discovery.cancel()
            await self.fleet.drop_pool(name)
            log.info("pool %s removed", name)
        for name, pc in wanted.items():
            old = self.live.get(name)
            if old is None:
                old = self.live[name] = LivePool(pc, State(canary=pc.spec.canary),
                                                 SignalWindow(d.window_s, d.min_requests), pc.spec)
            elif (old.config.spec.version, old.config.spec.weight, old.config.spec.canary) != \
                    (pc.spec.version, pc.spec.weight, pc.spec.canary):
                old.state = State(canary=pc.spec.canary)  # a new configuration starts afresh
            if (old.window.window_s, old.window.min_requests) != (d.window_s, d.min_requests):
                old.window = SignalWindow(d.window_s, d.min_requests)
            engine_changed = (old.config.engine, old.config.kv_events) != (pc.engine, pc.kv_events)
            source_changed = old.config.source != pc.source or engine_changed
            old.config = pc
            self.fleet.engines[name] = PoolEngine(pc.engine, pc.kv_events)
            if engine_changed and old.discovery is not None:  # replicas rejoin: their checks follow the new engine
                await self.fleet.drop_pool(name)
            if old.discovery is None or source_changed:
                if old.discovery is not None:
                    old.discovery.cancel()
                discovery = make_discovery(self.cfg, pc.source)
                old.discovery = asyncio.create_task(
                    discovery.run(lambda urls, pool=name: self.fleet.set_replicas(urls, pool)))
            self._refresh(old)
        self._recatalog()
        self._reorder()

    def _reorder(self) -> None:
        self._order = [self.live[p.spec.name].effective for p in self.config.pools if p.spec.name in self.live]
        by_name = {p.name: p for p in self._order}
        self._of_model = {m: [by_name[n] for n in names if n in by_name] for m, names in self.catalog.pools_of.items()}

    def _recatalog(self) -> None:
        """The models each pool serves changed (pools file, or what replicas list): the catalog follows."""
        cat = catalog([p.spec for p in self.config.pools], self.fleet.learned_models(), self.fleet.learned_adapters())
        if cat != self.catalog:
            if cat.models != self.catalog.models:
                log.info("models served: %s", ", ".join(f"{m} ({', '.join(ps)})" for m, ps in cat.pools_of.items())
                         or "none yet")
            self.catalog = cat
            self._reorder()
            for listener in self.catalog_listeners:
                listener()

    def _refresh(self, pool: LivePool) -> None:
        act = actions(self.config.degradation.thresholds, pool.state)
        pool.effective = degraded(pool.config.spec, act)
        pool.shed = act.shed

    # -- degradation ---------------------------------------------------------------------------------------
    async def _control_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.degradation.interval_s)
            try:
                self.evaluate(self.clock())
            except Exception:  # never let the loop die: the levels in force stay
                log.exception("pool degradation check failed")

    def evaluate(self, now: float) -> None:
        """Measure every pool's signals and move its degradation level (one step of the state machine)."""
        thresholds = self.config.degradation.thresholds
        for name, pool in self.live.items():
            loads = self.fleet.fresh_loads(name)
            for url, load in loads.items():
                pool.window.observe_counters(url, now, load.oom_events, load.alloc_failures)
            pool.window.retain(self.fleet.members.get(name, ()))
            kv = sum(x.kv_usage for x in loads.values()) / len(loads) if loads else None
            if loads:  # everyone's requests there: this router's share of the pool's traffic (sizing.py)
                pool.demand.observe_occupancy(now, sum(x.running + x.waiting for x in loads.values()))
            signals = pool.window.signals(now, kv)
            before = pool.state.level
            pool.state = step(thresholds, pool.state, signals, now)
            if pool.state.level is not before:
                self._changed(name, pool, before, signals)
        self._reorder()

    def _changed(self, name: str, pool: LivePool, before: Level, signals) -> None:
        self._refresh(pool)
        after = pool.state.level
        self.metrics.pool_changes.labels(name, before, after).inc()
        up = LEVELS.index(after) > LEVELS.index(before)
        known = {k: round(v, 4) for k, v in vars(signals).items() if v is not None}
        if after is Level.CANARY_ROLLBACK and up:
            log.warning("pool %s (%s): canary rolled back: weight %d -> 0 (signals %s); it stays at 0 until its "
                        "version or weight changes in the pools file", name, pool.config.spec.version,
                        pool.config.spec.weight, known)
        else:
            log.warning("pool %s (%s): degradation %s -> %s (signals %s)", name, pool.config.spec.version, before,
                        after, known)
        if after is Level.LOWER_MAX_TOKENS and up and pool.effective.default_max_tokens is None \
                and pool.effective.max_tokens_cap is None:
            log.warning("pool %s sets no default_max_tokens or max_tokens_cap: there is no max_tokens to lower", name)

    # -- per request ---------------------------------------------------------------------------------------
    def choose(self, model: str, session_key: str | None, prompt_tokens: int, max_tokens: int | None
               ) -> PoolChoice | PoolRefusal:
        """The pool for a request for `model` (router/pools/choice.py) among the pools that serve it, among
        those with a routable replica when one of them can take it; otherwise the choice over all of them
        stands (the proxy then answers 503)."""
        seed = self.cfg.hash_seed
        pools = self._of_model.get(model, ())
        choice = choose_pool(pools, session_key, prompt_tokens, max_tokens, seed, self.rng)
        if isinstance(choice, PoolRefusal) or self.fleet.ready_urls(choice.pool.name):
            return choice
        up = [p for p in pools if self.fleet.ready_urls(p.name)]
        other = choose_pool(up, session_key, prompt_tokens, max_tokens, seed, self.rng) if up else choice
        return other if isinstance(other, PoolChoice) else choice

    def prefill_pool(self, model: str) -> str | None:
        """The `role: prefill` pool of `model` with a routable replica (the first listed), for a decode pool."""
        pools = [p.name for p in self._of_model.get(model, ()) if p.role == "prefill"]
        return next((p for p in pools if self.fleet.ready_urls(p)), pools[0] if pools else None)

    def tokenizer_paths(self) -> dict[str, str]:
        """model -> the `tokenizer:` of the first pool serving it that names one."""
        named = {pc.spec.name: pc.tokenizer for pc in self.config.pools if pc.tokenizer}
        out = {}
        for model, pools in self.catalog.pools_of.items():
            path = next((named[p] for p in pools if p in named), None)
            if path is not None:
                out[model] = path
        return out

    def shedding(self, pool: str) -> bool:
        live = self.live.get(pool)
        return live is not None and live.shed

    def version(self, pool: str) -> str:
        live = self.live.get(pool)
        return live.config.spec.version if live is not None else "-"

    def record(self, pool: str, failed: bool, ttft_s: float | None, tpot_s: float | None) -> None:
        live = self.live.get(pool)
        if live is not None:
            live.window.record(self.clock(), failed, ttft_s, tpot_s)

    def served(self, pool: str, prompt_tokens: int, cached_tokens: int, output_tokens: int | None,
               duration_s: float, ttft_target_s: float | None, tpot_target_s: float | None, met: bool | None) -> None:
        """A request of `pool` ended (or was refused 429 slo_unattainable: output None, met False): the demand its
        size is planned for (router/pools/sizing.py)."""
        live = self.live.get(pool)
        if live is not None:
            live.demand.record(Served(self.clock(), prompt_tokens, cached_tokens, output_tokens, duration_s,
                                      ttft_target_s, tpot_target_s, met))

    def status(self) -> list[PoolStatus]:
        now = self.clock()
        out = []
        for name, p in self.live.items():
            urls = self.fleet.members.get(name, [])
            ready = sum(1 for u in urls if u in self.fleet.replicas and self.fleet.replicas[u].routable(now))
            placement = self.fleet.placement
            need = desired(placement.ttft, placement.tpot, p.demand.demand(now), ready, p.demand.goal)
            out.append(PoolStatus(name, p.config.spec.version, p.config.spec.weight, p.effective.weight,
                                  p.state.level, len(urls), ready, need))
        return out

"""The fleet simulator: a discrete-event loop that routes a `SimWorkload` over simulated engines
(kvfleet/sim/engine.py), optionally autoscaled by the chart's HPA (deploy/hpa.py), with peer pulls (link.py),
a lower KV tier per engine (tier.py) or prefill/decode disaggregation (disagg.py).

The router side (router.py) is the live router's own placement core (router/routing/placement.py), fed as the
HTTP router feeds it: a scrape of every replica's load each `scrape_interval_s` and each engine's KV events at
the end of every step it runs. Requests reach an engine the instant they are routed (no network).
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from deploy.hpa import HPA, HPASpec, MetricTarget, ScalingRules
from kvfleet.sim.cost import CostModel
from kvfleet.sim.disagg import Disagg
from kvfleet.sim.engine import SimEngine, SimSeq
from kvfleet.sim.link import PullLink
from kvfleet.sim.router import SIM_HASH_SEED, SimRouter
from kvfleet.sim.slo import Latency, percentile
from kvfleet.sim.tier import TierSpec
from kvfleet.sim.workload import SimWorkload, Turn
from router.config import ScoringConfig
from router.pools.choice import SLO_UNATTAINABLE
from router.routing.placement import HashedPrompt
from router.routing.policies import POLICIES
from router.routing.prefix_index import PrefixIndex
from router.routing.replicas import EngineLoad


@dataclass(frozen=True)
class Autoscale:
    """The chart's HPA (helm/kvfleet/values.yaml: pools[].autoscaling, autoscaling.scaleDownStabilizationSeconds)."""

    min_replicas: int = 1
    max_replicas: int = 4
    target_kv_usage: float = 0.8
    target_waiting: float = 2.0
    scale_down_stabilization_s: float = 600.0
    sync_s: float = 15.0  # the HPA controller's sync period
    start_s: float = 60.0  # a new replica takes this long to become ready

    def spec(self) -> HPASpec:
        from deploy.hpa import DEFAULT_SCALE_DOWN
        down = ScalingRules(self.scale_down_stabilization_s, DEFAULT_SCALE_DOWN.policies, DEFAULT_SCALE_DOWN.select)
        return HPASpec(self.min_replicas, self.max_replicas,
                       (MetricTarget("kv", self.target_kv_usage), MetricTarget("waiting", self.target_waiting)),
                       scale_down=down)


@dataclass(frozen=True)
class SimConfig:
    replicas: int
    policy: str
    cost: CostModel
    kv_tokens_per_replica: int
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    max_num_seqs: int = 128
    max_batched_tokens: int = 2048
    scrape_interval_s: float = 0.5
    scrape_stale_s: float = 3.0
    approx_max_blocks: int = 200_000
    autoscale: Autoscale | None = None
    pull: PullLink | None = None  # peer pulls over this link (None: a replica computes what it lacks)
    tier: TierSpec | None = None  # a lower KV tier on every replica (None: evicted blocks are gone)
    disagg: Disagg | None = None  # prefill/decode disaggregation (None: every replica does both)
    ttft_target_s: float | None = None  # every request's TTFT target: placed where the router predicts it met
    tpot_target_s: float | None = None  # every request's TPOT target, likewise
    slo_unattainable: str = "refuse"  # a request no replica is predicted to meet: refused (429), or "best_effort"
    stop_after_misses: int | None = None  # with targets: stop once more requests than this missed them (refused,
    # dropped, or done late): the attainment is then known to be below 1 - that / requests (`Simulator.stopped`)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {sorted(POLICIES)}, got {self.policy!r}")
        if self.replicas < 1:
            raise ValueError(f"replicas: must be >= 1, got {self.replicas}")
        if self.slo_unattainable not in SLO_UNATTAINABLE:
            raise ValueError(f"slo_unattainable: must be one of {', '.join(SLO_UNATTAINABLE)}, got "
                             f"{self.slo_unattainable!r}")
        if self.disagg is not None:
            if self.disagg.prefill_replicas >= self.replicas:
                raise ValueError(f"disagg: {self.disagg.prefill_replicas} prefill replicas leave none of "
                                 f"{self.replicas} to decode")
            if self.autoscale is not None:
                raise ValueError("disagg: autoscaling a disaggregated fleet is not modelled")
        self.scoring.validate()


@dataclass
class TurnResult:
    session: int
    turn: int
    replica: str
    arrival_s: float
    ttft_s: float | None = None
    tpot_s: float | None = None  # (last token - first token) / (output tokens - 1); None for one-token outputs
    hit_blocks: int = 0
    reloaded_blocks: int = 0  # of the hits, blocks reloaded from the replica's tier
    decode_replica: str | None = None  # disaggregated: the replica that decoded it
    num_blocks: int = 0
    predicted_cached_tokens: int = 0


class Simulator:
    def __init__(self, cfg: SimConfig, workload: SimWorkload):
        self.cfg = cfg
        self.wl = workload
        self.bs = workload.block_size
        self.num_blocks = max(cfg.kv_tokens_per_replica // self.bs, 1)
        scoring = cfg.pull.scoring(cfg.scoring, cfg.cost) if cfg.pull is not None else cfg.scoring
        scoring = cfg.tier.scoring(scoring, cfg.cost) if cfg.tier is not None else scoring
        self.router = SimRouter(cfg.policy, scoring, self.bs, SIM_HASH_SEED, cfg.scrape_stale_s,
                                cfg.approx_max_blocks)
        # disaggregated: `router` places over the prefill replicas, `decode_router` over the decode ones
        self.decode_router = SimRouter(cfg.disagg.decode_policy, cfg.scoring, self.bs, SIM_HASH_SEED,
                                       cfg.scrape_stale_s, cfg.approx_max_blocks) if cfg.disagg is not None else None
        self.routers: dict[str, SimRouter] = {}  # replica -> the router its KV events and loads go to
        self.pulls = self.pulled_blocks = 0
        self.engines: dict[str, SimEngine] = {}
        self._events: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()
        self._rid = itertools.count()
        self.results: list[TurnResult] = []
        self.dropped = 0
        self.refused = 0  # 429 slo_unattainable at the router (SimConfig.slo_unattainable "refuse")
        self.misses = 0  # requests that missed so far: refused, dropped, or done past a target
        self.stopped = False  # the run stopped at SimConfig.stop_after_misses, before every request was served
        self.replicas_over_time: list[tuple[float, int]] = []
        self._last_replica: dict[int, str] = {}
        self.follow_ups = self.follow_ups_home = 0
        self.now = 0.0
        self.end_s = 0.0  # the last request's end
        self._starting = 0  # replicas the HPA added that are not ready yet
        self._cancelled = 0  # of those, the ones a later scale-down removed
        self._pending_sessions = 0

    @property
    def members(self) -> list[str]:
        """The routable replicas, in the order they joined."""
        return self.router.members

    @property
    def index(self) -> PrefixIndex:
        """The router's exact index."""
        return self.router.placement.index

    # -- event loop ----------------------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def run(self) -> dict:
        prefill = self.cfg.disagg.prefill_replicas if self.cfg.disagg is not None else self.cfg.replicas
        for i in range(self.cfg.replicas):
            self._add_replica(0.0, decode=i >= prefill)
        self.replicas_over_time.append((0.0, len(self.members)))
        sessions = self.wl.sessions
        self._pending_sessions = len(sessions)
        if self.wl.concurrency:
            self._queue = list(reversed(range(len(sessions))))
            for _ in range(min(self.wl.concurrency, len(sessions))):
                self.at(0.0, self._next_session)
        else:
            for i, s in enumerate(sessions):
                self.at(s.start_s, functools.partial(self._arrive, si=i, ti=0))
        self.at(0.0, self._scrape)
        if self.cfg.autoscale is not None:
            self._hpa = HPA(self.cfg.autoscale.spec())
            self.at(self.cfg.autoscale.sync_s, self._autoscale)
        limit = self.cfg.stop_after_misses
        while self._events:
            t, _, fn = heapq.heappop(self._events)
            self.now = t
            fn(t)
            if limit is not None and self.misses > limit:
                self.stopped = True
                break
        return self.summary()

    def _next_session(self, t: float) -> None:
        if self._queue:
            self._arrive(t, self._queue.pop(), 0)

    # -- replicas ------------------------------------------------------------------------------------------
    def _add_replica(self, t: float, decode: bool = False) -> None:
        cfg = self.cfg
        if cfg.disagg is None:
            url = f"http://replica-{len(self.engines):03d}"
        else:
            url = f"http://{'decode' if decode else 'prefill'}-{len(self.engines):03d}"
        self.engines[url] = SimEngine(url, self.num_blocks, self.bs, cfg.cost, cfg.max_num_seqs,
                                      cfg.max_batched_tokens, tier=None if decode else cfg.tier)
        router = self.decode_router if decode and self.decode_router is not None else self.router
        self.routers[url] = router
        router.join(url, t)
        self._scrape_one(url, t)

    def _remove_replica(self) -> None:
        self.router.leave(self.members[-1])  # the newest; its running requests finish, nothing new goes there

    def _scrape_one(self, url: str, t: float) -> None:
        e = self.engines[url]
        load = EngineLoad(kv_usage=e.pool.usage, running=len(e.running), waiting=len(e.waiting),
                          kv_capacity_tokens=float(e.pool.num_blocks * self.bs), engine="kvfleet")
        self.routers[url].on_scrape(url, load, t)

    def _scrape(self, t: float) -> None:
        for url in self.members + (self.decode_router.members if self.decode_router is not None else []):
            self._scrape_one(url, t)
        if self._pending_sessions:
            self.at(t + self.cfg.scrape_interval_s, self._scrape)

    def _autoscale(self, t: float) -> None:
        """One HPA sync: `current` is the Deployment's count (starting pods included); pods not ready yet report
        zeros, as the controller assumes for a scale-up."""
        a, hpa = self.cfg.autoscale, self._hpa
        if a is None or hpa is None:  # scheduled only when autoscaling is on
            return
        zeros = [0.0] * self._starting
        kv = [self.engines[u].pool.usage for u in self.members] + zeros
        waiting = [float(len(self.engines[u].waiting)) for u in self.members] + zeros
        current = len(self.members) + self._starting
        desired = hpa.step(t, current, {"kv": kv, "waiting": waiting}).desired
        for _ in range(desired - current):
            self._starting += 1
            self.at(t + a.start_s, self._scaled_up)
        for _ in range(current - desired):
            if self._starting > self._cancelled:
                self._cancelled += 1  # a pod still starting goes first
            else:
                self._remove_replica()
        self._record(t)
        if self._pending_sessions:
            self.at(t + a.sync_s, self._autoscale)

    def _scaled_up(self, t: float) -> None:
        self._starting -= 1
        if self._cancelled:
            self._cancelled -= 1
            return
        self._add_replica(t)
        self._record(t)

    def _record(self, t: float) -> None:
        """(time, replicas ready) whenever the count changes (the last count at that time)."""
        last_t, last_n = self.replicas_over_time[-1]
        if last_n == len(self.members):
            return
        if last_t == t:
            self.replicas_over_time.pop()
        self.replicas_over_time.append((t, len(self.members)))

    # -- requests ------------------------------------------------------------------------------------------
    def _arrive(self, t: float, si: int, ti: int) -> None:
        session = self.wl.sessions[si]
        turn = session.turns[ti]
        prompt = HashedPrompt(turn.prompt_tokens, session.key, self.bs, SIM_HASH_SEED, turn.block_hashes,
                              self.cfg.ttft_target_s, self.cfg.tpot_target_s)
        if self.cfg.slo_unattainable == "refuse" and self.router.placement.unattainable(prompt, t) is not None:
            self.refused += 1  # as the HTTP router's admission (router/routing/fleet.py slo_refusal): no latency
            self.misses += 1
            self.results.append(TurnResult(si, ti, "", t, num_blocks=turn.num_blocks))
            self._turn_done(t, si, ti)
            return
        d, ticket = self.router.route(prompt, t)
        engine, router = self.engines[d.url], self.router
        res = TurnResult(si, ti, d.url, t, num_blocks=turn.num_blocks,
                         predicted_cached_tokens=d.predicted_cached_tokens)
        self.results.append(res)
        if ti > 0:
            self.follow_ups += 1
            self.follow_ups_home += self._last_replica.get(si) == d.url
        self._last_replica[si] = d.url

        disagg = self.cfg.disagg is not None

        def done(seq: SimSeq) -> None:
            router.on_done(d.url, ticket, seq)
            res.hit_blocks, res.reloaded_blocks = seq.hit_blocks, seq.reloaded_blocks
            if disagg:  # prefilled: the KV goes on to a decode replica
                self._hand_over(_times(seq)[1], prompt, turn, res, si, ti)
            else:
                self._finished(seq, res, si, ti)

        seq = SimSeq(next(self._rid), turn.block_hashes, turn.prompt_tokens, 1 if disagg else turn.output_tokens,
                     t, lambda s: router.on_first_token(d.url, ticket, s.first_token_s), done,
                     ttft_target=self.cfg.ttft_target_s, tpot_target=None if disagg else self.cfg.tpot_target_s)
        if not engine.fits(seq):
            self.dropped += 1
            self.misses += 1
            router.on_done(d.url, ticket)
            self._turn_done(t, si, ti)
            return
        if d.pull_from is not None and self.cfg.pull is not None:  # the engine pulls, then queues the request
            source = self.engines[d.pull_from]
            self.at(t + self.cfg.pull.seconds(d.pull_tokens), lambda t2: self._pulled(engine, source, seq, t2))
            return
        self._schedule(engine, engine.add(seq, t))

    def _hand_over(self, t: float, prompt: HashedPrompt, turn: Turn, res: TurnResult, si: int, ti: int) -> None:
        """A prefill replica finished the prompt at `t`: a decode replica is chosen, the prompt's KV crosses the
        link, and the request queues there to decode its whole output."""
        router, disagg = self.decode_router, self.cfg.disagg
        if router is None or disagg is None:  # only a disaggregated fleet hands requests over
            raise RuntimeError("hand-over in a colocated fleet")
        d, ticket = router.route(prompt, t)
        engine = self.engines[d.url]
        res.decode_replica = d.url

        def done(seq: SimSeq) -> None:
            router.on_done(d.url, ticket, seq)
            self._finished(seq, res, si, ti)

        seq = SimSeq(next(self._rid), (), turn.prompt_tokens, turn.output_tokens, res.arrival_s,
                     lambda s: router.on_first_token(d.url, ticket, s.first_token_s), done, prefilled=True,
                     tpot_target=self.cfg.tpot_target_s)
        if not engine.fits(seq):
            self.dropped += 1
            self.misses += 1
            router.on_done(d.url, ticket)
            self._turn_done(t, si, ti)
            return
        self.at(t + disagg.link.seconds(turn.prompt_tokens), lambda t2: self._schedule(engine, engine.add(seq, t2)))

    def _finished(self, seq: SimSeq, res: TurnResult, si: int, ti: int) -> None:
        first, end = _times(seq)
        res.ttft_s = first - res.arrival_s
        res.tpot_s = (end - first) / (seq.output - 1) if seq.output > 1 else None
        ttft, tpot = self.cfg.ttft_target_s, self.cfg.tpot_target_s
        self.misses += ((ttft is not None and res.ttft_s > ttft)
                        or (tpot is not None and res.tpot_s is not None and res.tpot_s > tpot))
        self._turn_done(end, si, ti)

    def _pulled(self, engine: SimEngine, source: SimEngine, seq: SimSeq, t: float) -> None:
        """The pull has crossed the link: what the source still holds past the engine's own prefix is now cached
        there (announced in its KV events at its next step), and the request queues."""
        n = engine.import_from(source, seq.hashes)
        self.pulls += n > 0
        self.pulled_blocks += n
        self._schedule(engine, engine.add(seq, t))

    def _turn_done(self, t: float, si: int, ti: int) -> None:
        self.end_s = max(self.end_s, t)
        session = self.wl.sessions[si]
        if ti + 1 < len(session.turns):
            self.at(t + self.wl.think_s, lambda t2: self._arrive(t2, si, ti + 1))
            return
        self._pending_sessions -= 1
        if self.wl.concurrency:
            self.at(t, self._next_session)

    def _schedule(self, engine: SimEngine, end: float | None) -> None:
        if end is None:
            return
        version = engine.version
        self.at(end, lambda t: self._step_end(engine, version, t))

    def _step_end(self, engine: SimEngine, version: int, t: float) -> None:
        if version != engine.version:
            return  # the stretch was cut short by an arrival; its new end is scheduled
        engine.finish(t)
        pool, router = engine.pool, self.routers[engine.name]
        if not router.on_kv_events(engine.name, pool.events.drain_events()):  # events were dropped: resync
            router.on_kv_events(engine.name, [engine.snapshot(self.bs, SIM_HASH_SEED)])
        self._schedule(engine, engine.start(t))

    # -- results -------------------------------------------------------------------------------------------
    def latencies(self) -> list[Latency]:
        """Every request's TTFT and TPOT (None: dropped, or one output token), in arrival order."""
        return [Latency(r.ttft_s, r.tpot_s) for r in self.results]

    def summary(self) -> dict:
        done = [r for r in self.results if r.ttft_s is not None]
        ttfts = sorted(r.ttft_s for r in done if r.ttft_s is not None)
        tpots = sorted(r.tpot_s for r in done if r.tpot_s is not None)
        per_replica: dict[str, int] = {u: 0 for u, r in self.routers.items() if r is self.router}
        for r in self.results:
            if r.replica:  # not refused
                per_replica[r.replica] += 1
        counts = list(per_replica.values())
        prefill = [e.prefill_tokens for e in self.engines.values()]
        blocks = sum(r.num_blocks for r in self.results)
        out = {
            "policy": self.cfg.policy, "replicas": self.cfg.replicas, "requests": len(self.results),
            "completed": len(done), "dropped": self.dropped, "refused": self.refused,
            "block_hit_rate": round(sum(r.hit_blocks for r in done) / blocks, 4) if blocks else 0.0,
            "ttft_p50": round(percentile(ttfts, 0.5), 4), "ttft_p99": round(percentile(ttfts, 0.99), 4),
            "ttft_mean": round(sum(ttfts) / len(ttfts), 4) if ttfts else 0.0,
            "max_over_mean_load": round(max(counts) / (sum(counts) / len(counts)), 3) if sum(counts) else 0.0,
            "max_over_mean_prefill": round(max(prefill) / (sum(prefill) / len(prefill)), 3) if sum(prefill) else 0.0,
            "follow_ups_home": round(self.follow_ups_home / self.follow_ups, 4) if self.follow_ups else None,
            "pulls": self.pulls, "pulled_blocks": self.pulled_blocks,
            "sim_seconds": round(self.end_s, 3),
            "mean_busy": _busy(list(self.engines.values()), self.end_s),
            "ttft_p90": round(percentile(ttfts, 0.9), 4),
            "tpot_p50": round(percentile(tpots, 0.5), 4), "tpot_p90": round(percentile(tpots, 0.9), 4),
        }
        if self.cfg.tier is not None:
            out["tier_reloaded_blocks"] = sum(e.reloaded_blocks for e in self.engines.values())
        if self.decode_router is not None:
            decode = set(self.decode_router.members)
            out["prefill_replicas"] = self.cfg.replicas - len(decode)
            out["mean_busy_prefill"] = _busy([e for u, e in self.engines.items() if u not in decode], self.end_s)
            out["mean_busy_decode"] = _busy([e for u, e in self.engines.items() if u in decode], self.end_s)
        if self.cfg.autoscale is not None:
            out["replicas_over_time"] = [[round(t, 1), n] for t, n in self.replicas_over_time]
        return out


def _times(seq: SimSeq) -> tuple[float, float]:
    """(first token, last token) of a finished sequence."""
    if seq.first_token_s is None or seq.done_s is None:  # the engine sets both before it calls on_done
        raise RuntimeError(f"sequence {seq.rid} done without its first-token and end times")
    return seq.first_token_s, seq.done_s


def _busy(engines: list[SimEngine], span_s: float) -> float:
    return round(sum(e.busy_s for e in engines) / len(engines) / span_s, 3) if engines and span_s else 0.0

"""The placement core: which replica of a pool takes one request, and the bookkeeping of what went where.

The HTTP router (fleet.py), the endpoint picker (router/epp/, through the same Fleet), the Ray Serve request router
(deploy/ray/routing_state.py) and the fleet simulator (kvfleet/sim/) drive this one object. Each feeds it what it observes - membership, readiness, load readings,
KV events (into `index`, through kv_events.EventApplier), first tokens and finishes - and asks it to place
requests. It owns the exact index (from KV events) and the approximate one (from where it sent prompts), one
`ReplicaState` per replica (router/routing/replicas.py: readiness, load, this router's in-flight and pending
prefill, circuit breaker), the pools' members and session rings, and the turn counter that rotates ties; what
each replica holds of a prompt, the views the policy sees, is router/routing/prediction.py's.
Pure: no I/O, and no clock of its own (every call that needs the time takes `now`).

    placement = Placement(POLICIES["kv"], PlacementConfig(scoring, block_size=16))
    placement.set_members(DEFAULT_POOL, urls)                      # -> Membership(joined, left, elsewhere)
    placement.on_health(url, True, now); placement.on_load(url, load, sent_at, now)
    d = placement.choose(prompt, now)                              # predicted hits, views, policy.choose
    ticket = placement.on_routed(d.url, prompt, d.predicted_cached_tokens, now, d.pull_from, d.prefill)
    placement.on_first_token(d.url, ticket, now); placement.on_decoded(ticket, output_tokens, now)
    placement.on_done(d.url, ticket)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from contract.hashing import DEFAULT_HASH_SEED
from contract.slo import step_bound
from router.config import ScoringConfig
from router.routing.approx_index import ApproxPrefixIndex
from router.routing.inflight_prefixes import InflightPrefixes
from router.routing.latency_model import LatencyModel, tpot_features, ttft_features
from router.routing.policies import Decision, HashRing, IndexKind, Policy, ReplicaView, RouteRequest
from router.routing.policies.load import prefill_tokens
from router.routing.prediction import BOUNDS_STEPS, Prediction, due
from router.routing.prefix_index import PrefixIndex
from router.routing.pull_rates import PullRates
from router.routing.replicas import CircuitBreaker, EngineLoad, ReplicaState, Ticket
from router.states import CircuitState, KVEventsState

DEFAULT_POOL = "default"  # the one pool of a router started without --pools (and of Ray and the simulator)


class Prompt(Protocol):
    """A request as placement reads it. router/routing/prepare.py's PreparedRequest is one; HashedPrompt
    below stands for prompts hashed once elsewhere (a Ray route hint, a simulated turn)."""

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def session_key(self) -> str | None: ...

    # optional: `adapter`, the LoRA adapter the request names (None: the base model); it keys the first block's
    # hash (contract/hashing.py) and makes replicas without it cost an adapter load

    def block_hashes(self, block_size: int, hash_seed: int) -> Sequence[int] | None:
        """The chained hashes of the prompt's cacheable blocks for these hashing parameters; None (or empty)
        when they are not known: an untokenized prompt, or one hashed with other parameters only."""
        ...


@dataclass(frozen=True, slots=True)
class Unattainable:
    """A latency target no replica is predicted to meet: which one ("ttft" or "tpot"), its seconds, and the best
    prediction among the replicas."""

    which: str
    target_s: float
    best_s: float


@dataclass(frozen=True, slots=True)
class HashedPrompt:
    """A prompt whose block hashes were computed once, with one block size and hash seed."""

    num_prompt_tokens: int = 0
    session_key: str | None = None
    block_size: int = 16
    hash_seed: int = DEFAULT_HASH_SEED
    hashes: tuple[int, ...] | None = None  # None: not tokenized
    ttft_target_s: float | None = None  # the request's TTFT target, if any (placed where it is predicted met)
    tpot_target_s: float | None = None  # its TPOT target, likewise

    def block_hashes(self, block_size: int, hash_seed: int) -> Sequence[int] | None:
        return self.hashes if (block_size, hash_seed) == (self.block_size, self.hash_seed) else None


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    block_size: int = 16  # the fleet's block hashing: what the approximate index records
    hash_seed: int = DEFAULT_HASH_SEED
    approx_max_blocks: int = 200_000
    stale_s: float = 3.0  # a load reading older than this is unknown load
    grace_s: float = 0.2  # requests dispatched this long before a reading was taken are not in it yet
    breaker_failures: int = 3
    breaker_open_s: float = 5.0
    # how long a prompt routed to a replica counts as held there before its KV events say so
    # (router/routing/inflight_prefixes.py): a burst on a new prompt stays with the replica computing it, or with
    # pulls on pulls from it; 0: never
    inflight_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("block_size", "approx_max_blocks", "breaker_failures"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("stale_s", "grace_s", "breaker_open_s", "inflight_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class Membership:
    """What one set_members call changed."""

    joined: tuple[str, ...] = ()
    left: tuple[str, ...] = ()
    elsewhere: tuple[str, ...] = ()  # listed, but another pool holds them: they stay there


class Placement:
    def __init__(self, policy: Policy, cfg: PlacementConfig | None = None):
        self.policy = policy
        self.cfg = cfg = cfg or PlacementConfig()
        self.index = PrefixIndex()
        self.approx = ApproxPrefixIndex(cfg.approx_max_blocks)
        self.pull_rates = PullRates()  # --pull-token-cost auto: the engines' measured rates
        self.inflight = InflightPrefixes(cfg.inflight_s or 1.0)  # prompts routed, not in KV events yet
        self.replicas: dict[str, ReplicaState] = {}
        self.members: dict[str, list[str]] = {}  # pool -> its replicas, in the order the driver listed them
        self.pool_of: dict[str, str] = {}  # replica -> its pool
        self.rings: dict[str, HashRing] = {}  # pool -> the session ring over its members
        self.turn = 0  # advanced once per decision: rotates ties (and round-robin)
        self.prediction = Prediction(self)  # what each replica holds of a prompt: the views the policy sees
        self.ttft = LatencyModel()  # time to first token from a replica's load and the request, fitted from first tokens
        self.tpot = LatencyModel()  # time per output token likewise, fitted from finished streams
        self.tpot_paced = LatencyModel()  # the share of its step bound a stream with one went at (latency_model.py)

    # -- membership ----------------------------------------------------------------------------------------
    def set_members(self, pool: str, replicas: Iterable[str]) -> Membership:
        """A pool's current replicas: new ones join (not ready until on_health says so), missing ones leave
        (their blocks leave both indexes; their in-flight requests may still finish). A replica belongs to
        one pool: one that another pool holds stays there."""
        wanted: list[str] = []
        elsewhere: list[str] = []
        for r in dict.fromkeys(replicas):
            (wanted if self.pool_of.get(r, pool) == pool else elsewhere).append(r)
        left = [r for r in self.members.get(pool, []) if r not in wanted]
        for r in left:
            self._forget(r)
        joined = [r for r in wanted if r not in self.replicas]
        for r in joined:
            self.pool_of[r] = pool
            self.replicas[r] = ReplicaState(r, CircuitBreaker(self.cfg.breaker_failures, self.cfg.breaker_open_s),
                                            self.cfg.grace_s)
        self.members[pool] = wanted
        self.rings[pool] = HashRing(wanted, self.cfg.scoring.session_vnodes)
        return Membership(tuple(joined), tuple(left), tuple(elsewhere))

    def drop_pool(self, pool: str) -> Membership:
        """The pool is gone: its replicas leave."""
        m = self.set_members(pool, ())
        self.members.pop(pool, None)
        self.rings.pop(pool, None)
        return m

    def remove(self, replica: str) -> None:
        """One replica leaves its pool."""
        pool = self.pool_of.get(replica)
        if pool is not None and replica in self.members.get(pool, ()):
            self.set_members(pool, [r for r in self.members[pool] if r != replica])
        else:
            self._forget(replica)

    def _forget(self, replica: str) -> None:
        self.replicas.pop(replica, None)
        self.pool_of.pop(replica, None)
        if self.index.has(replica):
            self.index.drop(replica)
        self.approx.drop(replica)
        self.inflight.drop(replica)
        self.pull_rates.drop(replica)

    # -- what the drivers observe --------------------------------------------------------------------------
    def on_health(self, replica: str, ready: bool, now: float) -> bool:
        """A readiness check; True when it changed the replica's readiness. A replica that comes back gets
        traffic again at once (its circuit closes)."""
        st = self.replicas.get(replica)
        if st is None or st.ready == ready:
            return False
        st.ready = ready
        if ready and st.breaker.state(now) is not CircuitState.CLOSED:
            st.breaker.on_success()
        return True

    def on_kv_events(self, replica: str, state: KVEventsState) -> None:
        """The state of the replica's KV event stream (which index predicts its hits: PolicyNeeds.index_for)."""
        st = self.replicas.get(replica)
        if st is not None:
            st.kv_events = state

    def on_models(self, replica: str, models: frozenset[str] | None, adapters: frozenset[str] = frozenset()) -> bool:
        """The model ids the replica's /v1/models lists (None: it lists none), and which of them are LoRA adapters
        (listed with a parent); True when that changed."""
        st = self.replicas.get(replica)
        if st is None or (st.models == models and st.adapters == adapters):
            return False
        st.models, st.adapters = models, adapters
        return True

    def on_adapter_loaded(self, replica: str, adapter: str) -> None:
        """The router had the replica load an adapter: it holds it now (its next /v1/models says so too)."""
        st = self.replicas.get(replica)
        if st is not None:
            st.models = (st.models or frozenset()) | {adapter}
            st.adapters = st.adapters | {adapter}

    def is_adapter(self, model: str) -> bool:
        """Whether some replica lists `model` as a LoRA adapter (on /v1/models, or in vllm:lora_requests_info)."""
        return any(model in st.adapters or (st.load is not None and st.load.lora is not None
                                            and model in st.load.lora.held) for st in self.replicas.values())

    def holders(self, pool: str, adapter: str) -> list[str]:
        """The pool's replicas that hold the adapter."""
        return [u for u in self.members.get(pool, ()) if self.replicas[u].holds(adapter)]

    def on_load(self, replica: str, load: EngineLoad, sent_at: float, now: float) -> None:
        """A load reading asked for at `sent_at`, answered at `now`."""
        st = self.replicas.get(replica)
        if st is not None:
            st.on_scrape(load, sent_at, now)
            if self.cfg.scoring.pull_cost_measured:
                self.pull_rates.on_load(replica, load, now)

    def on_load_failed(self, replica: str) -> None:
        st = self.replicas.get(replica)
        if st is not None:
            st.on_scrape_failed()

    # -- queries -------------------------------------------------------------------------------------------
    def _urls(self, pool: str | None) -> list[str]:
        return list(self.replicas) if pool is None else self.members.get(pool, [])

    def ready_urls(self, now: float, pool: str | None = None) -> list[str]:
        """Routable replicas, of one pool or (None) of all."""
        return [u for u in self._urls(pool) if self.replicas[u].routable(now)]

    def room(self, pool: str, now: float, slots: int, kv_limit: float) -> int:
        """Requests the pool's routable replicas can take now, `slots` each: minus what each holds (its last
        scrape's running + waiting, plus this router's requests sent since, minus those finished since; at least
        this router's own in flight there); none on a replica at or past `kv_limit` KV usage."""
        free = 0
        for u in self.members.get(pool, ()):
            st = self.replicas[u]
            if not st.routable(now):
                continue
            held = len(st.tickets)
            load = st.load
            if load is not None and st.load_known(now, self.cfg.stale_s):
                if load.kv_usage >= kv_limit:
                    continue
                new = sum(1 for t in st.tickets if t.dispatched_at > st.covered_until)
                held = max(held, load.running + load.waiting + new - st.finished)
            free += max(0, slots - held)
        return free

    def learned_models(self) -> dict[str, frozenset[str]]:
        """Per pool, the models its replicas list (the union over those that answered; absent: none has)."""
        out: dict[str, frozenset[str]] = {}
        for pool, urls in self.members.items():
            listed = [m for u in urls if (m := self.replicas[u].models) is not None]
            if listed:
                out[pool] = frozenset().union(*listed)
        return out

    def learned_adapters(self) -> dict[str, frozenset[str]]:
        """Per pool, the LoRA adapters its replicas list (with a parent model) on /v1/models."""
        return {pool: frozenset().union(*(self.replicas[u].adapters for u in urls))
                for pool, urls in self.members.items() if urls}

    def not_serving(self, pool: str, model: str) -> frozenset[str]:
        """The pool's replicas that list models, but not this one (a request for it must not go there)."""
        return frozenset(u for u in self.members.get(pool, ())
                         if self.replicas[u].models is not None and not self.replicas[u].holds(model))

    def fresh_loads(self, now: float, pool: str | None = None) -> dict[str, EngineLoad]:
        """The load of each routable replica (of one pool, or all) whose reading is fresh."""
        out = {}
        for u in self._urls(pool):
            st = self.replicas[u]
            if st.routable(now) and st.load_known(now, self.cfg.stale_s) and st.load is not None:
                out[u] = st.load
        return out

    @property
    def pulls(self) -> bool:
        return self.cfg.scoring.pull_token_cost > 0

    @property
    def inflight_on(self) -> bool:
        """Prompts routed count as on their way into the replica's cache (cfg.inflight_s > 0): a burst on a new
        prompt stays with the replica computing it (or, with pulls on, pulls from it) while load allows."""
        return self.cfg.inflight_s > 0

    def predict_cached(self, prompt: Prompt, replicas: Sequence[str], now: float | None = None,
                       on_the_way: dict[str, str | None] | None = None, tiered: dict[str, int] | None = None
                       ) -> dict[str, int]:
        """Per replica, the prompt tokens its prefix cache holds (router/routing/prediction.py)."""
        return self.prediction.predict_cached(prompt, replicas, now, on_the_way, tiered)

    def views(self, prompt: Prompt, replicas: Sequence[str], now: float,
              excluded: set[str] | frozenset[str] = frozenset()) -> list[ReplicaView]:
        """What the policy sees of each replica for this request (router/routing/prediction.py)."""
        return self.prediction.views(prompt, replicas, now, excluded)

    # -- placing -------------------------------------------------------------------------------------------
    def choose(self, prompt: Prompt, now: float, pool: str = DEFAULT_POOL,
               excluded: set[str] | frozenset[str] = frozenset(),
               candidates: Sequence[str] | None = None, peek: bool = False) -> Decision | None:
        """The policy's replica of `pool` for the request (among `candidates` only, in their order, when
        given), or None when none is routable. Nothing is booked: on_routed does that. peek: a look ahead at the
        decision (router/routing/adapters.py) that does not advance the turn, so the next choose sees the same."""
        replicas = self.members.get(pool, [])
        ring = self.rings.get(pool)
        if candidates is not None:
            mine = set(replicas)
            replicas = [r for r in candidates if r in mine]
        if not replicas or ring is None:
            return None
        views = self.views(prompt, replicas, now, excluded)
        ttft, tpot = getattr(prompt, "ttft_target_s", None), getattr(prompt, "tpot_target_s", None)
        if (ttft is not None or tpot is not None) and (slow := self.prediction.missing_target(views, prompt, ttft, tpot)):
            views = [replace(v, routable=False) if v.url in slow else v for v in views]
        turn = self.turn
        if not peek:
            self.turn += 1
        scoring = self.scoring()
        req = RouteRequest(prompt.num_prompt_tokens, prompt.session_key)
        d = self.policy.choose(views, req, scoring, ring, turn)
        if d is not None and d.pull_tokens:
            source = self.prediction.pull_source(d, views)
            pending = any(v.url == d.url and v.peer_on_the_way for v in views)
            chosen = next(v for v in views if v.url == d.url)
            d = replace(d, pull_from=source, pull_pending=pending) if source is not None else replace(
                d, pull_tokens=0, predicted_cached_tokens=d.predicted_cached_tokens - d.pull_tokens,
                prefill=prefill_tokens(chosen, req, replace(scoring, pull_token_cost=0.0)))
        elif d is not None and (v := next(v for v in views if v.url == d.url)).pulling_from is not None:
            # its copy there is a pull on its way: this request joins it (the engine starts it if this one is first)
            d = replace(d, pull_from=v.pulling_from, pull_pending=v.pulling_pending)
        return d

    def scoring(self) -> ScoringConfig:
        """The scoring the policy uses now: with `--pull-token-cost auto`, the pulls' cost the engines measure."""
        scoring = self.cfg.scoring
        if scoring.pull_cost_measured:
            scoring = replace(scoring, pull_token_cost=self.pull_rates.cost(scoring.pull_token_cost))
        return scoring

    def predict_ttft(self, prompt: Prompt, now: float, pool: str = DEFAULT_POOL,
                     excluded: set[str] | frozenset[str] = frozenset()) -> dict[str, float]:
        """Per routable replica of `pool`, the predicted seconds to the request's first token there (its cached
        prefix and the load it would join); empty while the TTFT model is not ready."""
        if not self.ttft.ready:
            return {}
        return self.prediction.ttft(self.views(prompt, self.members.get(pool, []), now, excluded), prompt)

    def unattainable(self, prompt: Prompt, now: float, pool: str = DEFAULT_POOL) -> Unattainable | None:
        """The request's first target (TTFT, then TPOT) that no routable replica of `pool` is predicted to meet,
        with the best prediction; None when every target it carries is predicted met somewhere, or while the
        model for it is not ready (no prediction: nothing is unattainable). The admission's one rule: the HTTP
        router refuses such a request (or serves it best effort), the simulator likewise."""
        for which, target, predict in (("ttft", getattr(prompt, "ttft_target_s", None), self.predict_ttft),
                                       ("tpot", getattr(prompt, "tpot_target_s", None), self.predict_tpot)):
            if target is None:
                continue
            predicted = predict(prompt, now, pool)
            if predicted and (best := min(predicted.values())) > target:
                return Unattainable(which, target, best)
        return None

    def predict_tpot(self, prompt: Prompt, now: float, pool: str = DEFAULT_POOL,
                     excluded: set[str] | frozenset[str] = frozenset()) -> dict[str, float]:
        """Per routable replica of `pool`, the predicted seconds per output token there (the batch the request
        would join); empty while the TPOT model is not ready."""
        if not self.tpot.ready:
            return {}
        return self.prediction.tpot(self.views(prompt, self.members.get(pool, []), now, excluded), prompt)

    def on_routed(self, replica: str, prompt: Prompt, predicted_cached_tokens: int, now: float,
                  pull_from: str | None = None, prefill: float | None = None) -> Ticket | None:
        """The request went to `replica` (None: the replica is not known, nothing to book), to pull its prefix
        from `pull_from` when given; `prefill`: its prompt work there in prefill tokens as the decision costed it
        (Decision.prefill; None: its uncached tokens), what the TTFT model learns from. Its uncached prompt tokens
        are in flight there, pending prefill until on_first_token; the attempt counts for the circuit; the
        approximate index learns where the prompt went, for replicas the policy predicts from it, the prompts on
        their way where the exact one predicts."""
        st = self.replicas.get(replica)
        if st is None:
            return None
        view = st.view(now, self.cfg.stale_s, due_at=due(prompt, now))
        uncached = max(prompt.num_prompt_tokens - predicted_cached_tokens, 0)
        x = ttft_features(view, uncached if prefill is None else prefill)
        y = tpot_features(view, prompt.num_prompt_tokens)
        ticket = st.on_dispatch(uncached, now, getattr(prompt, "ttft_target_s", None))
        ticket.ttft_features, ticket.predicted_ttft_s = x, self.ttft.predict(x)
        ticket.tpot_features, ticket.predicted_tpot_s = y, self.prediction.tpot_at(view, prompt)
        if (tpot_target := getattr(prompt, "tpot_target_s", None)) is not None and st.engine in BOUNDS_STEPS:
            ticket.tpot_bound_s = step_bound(tpot_target)
        st.breaker.on_attempt(now)
        kind = self.policy.needs.index_for(st.kv_events)
        if kind is IndexKind.APPROX:
            hashes = prompt.block_hashes(self.cfg.block_size, self.cfg.hash_seed)
            if hashes:
                self.approx.record(replica, hashes)
        elif kind is IndexKind.EXACT and self.inflight_on and (params := self.index.params.get(replica)) is not None:
            hashes = prompt.block_hashes(*params)
            if hashes:
                self.inflight.record(replica, hashes, now, pull_from)
        return ticket

    def on_first_token(self, replica: str, ticket: Ticket, now: float | None = None) -> float | None:
        """The replica streamed the request's first token: its prefill is no longer ahead there. A driver that
        cannot see first tokens leaves the request pending until on_done. With `now`, the TTFT model learns from it
        (the first of an attempt only); returns the observed TTFT then."""
        st = self.replicas.get(replica)
        if st is None:
            return None
        first = ticket.prefilling
        st.on_first_token(ticket)
        if now is None or not first or ticket.ttft_features is None:
            return None
        ticket.first_token_at = now
        seconds = now - ticket.dispatched_at
        self.ttft.observe(ticket.ttft_features, seconds)
        return seconds

    def on_decoded(self, ticket: Ticket, output_tokens: int, now: float) -> float | None:
        """The request's stream ended on the replica with `output_tokens` generated: the TPOT model learns the
        seconds per token after the first (a stream whose first token was seen at `now` by on_first_token, and
        that generated at least two). Returns the observed TPOT then."""
        first = ticket.first_token_at
        if first is None or output_tokens < 2 or ticket.tpot_features is None or now < first:
            return None
        seconds = (now - first) / (output_tokens - 1)
        self.tpot.observe(ticket.tpot_features, seconds)
        if ticket.tpot_bound_s is not None:
            self.tpot_paced.observe(ticket.tpot_features, seconds / ticket.tpot_bound_s)
        return seconds

    def on_done(self, replica: str, ticket: Ticket) -> None:
        """The request left the replica (finished, failed or abandoned)."""
        st = self.replicas.get(replica)
        if st is not None:
            st.on_done(ticket)

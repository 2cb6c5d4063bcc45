"""Router configuration: one frozen dataclass, validated once at the edge (CLI), clear errors by field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from urllib.parse import urlsplit

from contract.errors import ConfigError
from contract.hashing import DEFAULT_HASH_SEED

# the routing policies by name (router/routing/policies/ registers one object for each)
POLICY_NAMES = ("kv", "approx-prefix", "session", "least-load", "round-robin")

DISCOVERY_KINDS = ("static", "dns", "k8s")
ENGINE_TYPES = ("auto", "kvfleet", "vllm", "sglang")


@dataclass(frozen=True)
class ScoringConfig:
    """Weights and limits of the routing score (pure policy inputs)."""

    # Load in prefill-token equivalents: each KV token held by running requests (their contexts being
    # decoded; off by default: at 0.5 it sent follow-ups away from their history, see docs/results.md),
    # each waiting request another router sent (a whole unknown prompt to prefill first; this router's own
    # are counted by their measured prefill), each running request (per-sequence overhead in every step).
    kv_token_cost: float = 0.0
    # The prefill a request would add (its uncached prompt) counts this many times against the prefill already
    # queued ahead of it (measured per replica, see router/routing/policies/load.py): a miss makes the fleet redo work.
    prefill_weight: float = 3.0
    waiting_cost_tokens: float = 256.0
    running_cost_tokens: float = 32.0
    # A replica is overloaded (no affinity, no cache misses) past either limit.
    overload_waiting: int = 8  # waiting requests + requests sent since the last scrape
    overload_kv_usage: float = 0.95
    # Consistent hashing with bounded load: a replica takes at most c * average load.
    session_load_factor: float = 1.25
    session_vnodes: int = 64
    # Peer pulls (issue 31): a cached prefix a peer replica holds can be pulled instead of recomputed, at this
    # cost per token and per pull, in prefill-token units (the transfer's seconds over a prefill token's);
    # pull_token_cost 0: no pulls. The simulator derives both from a link's bandwidth and latency.
    pull_token_cost: float = 0.0
    pull_fixed_tokens: float = 0.0
    # pull_token_cost measured from the engines' rates (router/routing/pull_rates.py); pull_token_cost is then the
    # prior, used until both rates are known
    pull_cost_measured: bool = False
    # A prompt token a replica's lower KV tier holds (engine/kv/tier.py) costs this much to reload, in prefill tokens.
    tier_token_cost: float = 0.1

    def validate(self) -> None:
        if not self.prefill_weight >= 1:
            raise ConfigError("prefill_weight", f"must be >= 1, got {self.prefill_weight}")
        for name in ("kv_token_cost", "waiting_cost_tokens", "running_cost_tokens", "pull_token_cost",
                     "pull_fixed_tokens", "tier_token_cost"):
            if not getattr(self, name) >= 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")
        if self.overload_waiting < 1:
            raise ConfigError("overload_waiting", f"must be >= 1, got {self.overload_waiting}")
        if not 0 < self.overload_kv_usage <= 1:
            raise ConfigError("overload_kv_usage", f"must be in (0, 1], got {self.overload_kv_usage}")
        if not self.session_load_factor > 1:
            raise ConfigError("session_load_factor", f"must be > 1, got {self.session_load_factor}")
        if self.session_vnodes < 1:
            raise ConfigError("session_vnodes", f"must be >= 1, got {self.session_vnodes}")


@dataclass(frozen=True)
class VllmEventsConfig:
    """Where vLLM engines publish their KV events (ZMQ), from `--vllm-kv-events SPEC` (repeatable):
    `tcp://{host}:5557|tcp://{host}:5558` for every replica ({host}: the replica's host; `|REPLAY` optional),
    or `http://10.0.0.7:8000=tcp://10.0.0.7:5557|tcp://10.0.0.7:5558` for one replica."""

    default: tuple[str, str | None] | None = None
    per_replica: tuple[tuple[str, tuple[str, str | None]], ...] = ()

    @classmethod
    def parse(cls, specs) -> VllmEventsConfig:
        default, per = None, {}
        for spec in specs:
            target, sep, endpoints = spec.partition("=")
            if not sep:
                target, endpoints = None, spec
            pub, _, replay = endpoints.partition("|")
            for ep in (pub, replay):
                if ep and not ep.startswith(("tcp://", "ipc://")):
                    raise ConfigError("vllm_kv_events", f"{spec!r}: endpoints are tcp://HOST:PORT (or ipc://), "
                                      f"got {ep!r}")
            pair = (pub, replay or None)
            if target is None:
                default = pair
            else:
                per[check_replica_url(target)] = pair
        return cls(default, tuple(per.items()))

    def endpoints(self, url: str) -> tuple[str, str | None] | None:
        """The (publisher, replay) endpoints of a replica, or None when it publishes none."""
        for u, pair in self.per_replica:
            if u == url:
                return pair
        if self.default is None:
            return None
        host = urlsplit(url).hostname or ""
        host = f"[{host}]" if ":" in host else host
        return self.default[0].replace("{host}", host), (self.default[1] or "").replace("{host}", host) or None


@dataclass(frozen=True)
class SheddingConfig:
    kv_high: float = 0.90
    waiting_high: float = 2.0
    kv_critical: float = 0.98
    waiting_critical: float = 8.0
    min_cost_tokens: int = 2048
    retry_after_s: int = 2

    def validate(self) -> None:
        if not 0 < self.kv_high <= self.kv_critical <= 1:
            raise ConfigError("shed_kv_high", "needs 0 < kv_high <= kv_critical <= 1")
        if not 0 <= self.waiting_high <= self.waiting_critical:
            raise ConfigError("shed_waiting_high", "needs 0 <= waiting_high <= waiting_critical")
        if self.min_cost_tokens < 1 or self.retry_after_s < 1:
            raise ConfigError("shed_min_cost_tokens", "min_cost_tokens and retry_after_s must be >= 1")


@dataclass(frozen=True)
class RateLimitConfig:
    tenants_file: str | None = None  # None: no tenants, no keys, no budgets
    redis_url: str | None = None  # None: budgets in this router's memory
    on_store_error: str = "open"
    heartbeat_s: float = 2.0  # routers count each other through Redis at this period
    usage_reconcile_after_s: float = 3600.0  # an unsettled request's pending ledger record is due after this
    shedding: SheddingConfig = dataclasses.field(default_factory=SheddingConfig)

    def validate(self) -> None:
        if not 0 < self.usage_reconcile_after_s < float("inf"):
            raise ConfigError("usage_reconcile_after_s", f"must be a number of seconds > 0, got "
                                                         f"{self.usage_reconcile_after_s}")
        if self.on_store_error not in ("open", "closed"):
            raise ConfigError("ratelimit_on_store_error", f"must be open or closed, got {self.on_store_error!r}")
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError("redis_url", f"must be a redis://, rediss:// or unix:// URL, got {self.redis_url!r}")
        if self.redis_url is not None and self.tenants_file is None:
            raise ConfigError("redis_url", "needs --tenants (budgets are per tenant)")
        if not self.heartbeat_s > 0:
            raise ConfigError("heartbeat_s", f"must be > 0, got {self.heartbeat_s}")
        self.shedding.validate()


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "kv"  # one of POLICY_NAMES (router/routing/policies/ holds the objects)
    model: str | None = "smollm2"  # tokenizer for prefix matching (same as the engines')
    tokenizer_from_engines: bool = False  # fetch the tokenizer from the first ready engine instead of `model`
    default_model: str | None = None  # written into requests that name no model (None: they get 400)
    engine_type: str = "auto"  # what the replicas are; auto: /ready (else /health) and KV events if served
    discovery: str = "static"
    replicas: tuple[str, ...] = ()  # static discovery
    dns_name: str | None = None  # headless Service name, e.g. kvfleet-engine.ns.svc.cluster.local
    dns_port: int = 8000
    dns_interval_s: float = 5.0
    dns_nameserver: str | None = None  # "ip" or "ip:port"; default: the system resolver
    k8s_service: str | None = None
    k8s_namespace: str = "default"
    k8s_port_name: str | None = None  # EndpointSlice port name; None = the first port
    k8s_resync_s: float = 60.0
    inference_pool: str | None = None  # discovery "inference-pool" (kvfleet epp): the InferencePool's name
    scheme: str = "http"
    health_interval_s: float = 1.0
    scrape_interval_s: float = 0.5
    scrape_stale_s: float = 3.0  # older scrapes are unknown load, not zero
    kv_heartbeat_timeout_s: float = 6.0
    hash_seed: int = DEFAULT_HASH_SEED  # until a replica's snapshot says otherwise
    block_size: int = 16
    approx_max_blocks: int = 200_000
    breaker_failures: int = 3
    breaker_open_s: float = 5.0
    max_attempts: int = 3
    max_migrations: int = 2  # breaks after tokens went out that a stream may survive (0: none moves)
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 600.0
    internal_token: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    access_log: bool = False  # one INFO line per proxied request
    pools_file: str | None = None  # None: one pool, "default", from the discovery flags
    replica_slots: int = 0  # > 0: a pool whose replicas hold this many requests each queues the rest fairly
    forward_priority: bool = False  # send the tenant's priority upstream as the engines' `priority` field
    queue_timeout_s: float = 30.0
    queue_max_per_tenant: int = 256
    queue_max_total: int = 1024
    vllm_events: VllmEventsConfig = dataclasses.field(default_factory=VllmEventsConfig)
    scoring: ScoringConfig = dataclasses.field(default_factory=ScoringConfig)
    ratelimit: RateLimitConfig = dataclasses.field(default_factory=RateLimitConfig)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ConfigError("policy", f"must be one of {', '.join(POLICY_NAMES)}, got {self.policy!r}")
        if self.default_model is not None and not self.default_model:
            raise ConfigError("default_model", "must be a model name")
        if self.engine_type not in ENGINE_TYPES:
            raise ConfigError("engine_type", f"must be one of {', '.join(ENGINE_TYPES)}, got {self.engine_type!r}")
        if self.scoring.pull_token_cost > 0 and self.engine_type in ("vllm", "sglang"):
            raise ConfigError("pull_token_cost", f"peer pulls need kvfleet engines; {self.engine_type} engines cannot "
                                                 f"pull a prefix from a peer (set it to 0)")
        if self.discovery not in (*DISCOVERY_KINDS, "inference-pool"):
            raise ConfigError("discovery", f"must be one of {', '.join(DISCOVERY_KINDS)}, got {self.discovery!r}")
        if self.discovery == "inference-pool" and not self.inference_pool:
            raise ConfigError("inference_pool", "inference-pool discovery needs the InferencePool's name")
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", f"must be in 0..65535, got {self.port}")
        if self.scheme not in ("http", "https"):
            raise ConfigError("scheme", f"must be http or https, got {self.scheme!r}")
        for url in self.replicas:
            check_replica_url(url)
        if self.pools_file is not None and (self.replicas or self.dns_name or self.k8s_service or self.inference_pool):
            raise ConfigError("pools", "--pools lists each pool's replicas; do not also give --replicas, "
                              "--dns-name or --k8s-service")
        if self.pools_file is None and self.discovery == "static" and not self.replicas:
            raise ConfigError("replicas", "static discovery needs at least one replica URL (or --pools)")
        if self.discovery == "dns" and not self.dns_name:
            raise ConfigError("dns_name", "dns discovery needs the headless Service name")
        if self.discovery == "k8s" and not self.k8s_service:
            raise ConfigError("k8s_service", "k8s discovery needs the Service name")
        if not 0 < self.dns_port <= 65535:
            raise ConfigError("dns_port", f"must be in 1..65535, got {self.dns_port}")
        positive = ("dns_interval_s", "k8s_resync_s", "health_interval_s", "scrape_interval_s", "scrape_stale_s",
                    "kv_heartbeat_timeout_s", "breaker_open_s", "connect_timeout_s", "request_timeout_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}")
        if self.scrape_stale_s < self.scrape_interval_s:
            raise ConfigError("scrape_stale_s", "must be >= scrape_interval_s")
        if self.max_migrations < 0:
            raise ConfigError("max_migrations", f"must be >= 0 (0: streams never move), got {self.max_migrations}")
        if self.replica_slots < 0:
            raise ConfigError("replica_slots", f"must be >= 0 (0: no queue), got {self.replica_slots}")
        if not self.queue_timeout_s > 0 or self.queue_max_per_tenant < 1 or self.queue_max_total < 1:
            raise ConfigError("queue_timeout_s", "the queue's timeout must be > 0 and its limits >= 1")
        for name in ("block_size", "approx_max_blocks", "breaker_failures", "max_attempts", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.hash_seed < 2**64:
            raise ConfigError("hash_seed", "must be in 0 .. 2**64-1")
        self.scoring.validate()
        self.ratelimit.validate()


def check_replica_url(url: str) -> str:
    """A replica base URL such as http://10.0.0.7:8000 (no path, query or fragment)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError("replicas", f"not an http(s) base URL: {url!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError("replicas", f"a replica URL has no path/query: {url!r}")
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise ConfigError("replicas", f"bad port in {url!r}") from exc
    return url.rstrip("/")

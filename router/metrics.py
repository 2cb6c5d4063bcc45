"""The router's Prometheus metrics (`kvfleet_router_*`), one registry per router process.

Per-replica gauges (circuit state, readiness, in-flight, indexed blocks) are computed at scrape time from the
fleet, so a replica that leaves the fleet leaves the metrics too.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from router.states import CircuitState, KVEventsState

_DECISION_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1)
_TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384)
_RELATIVE_BUCKETS = (0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
_TTFT_ERROR_BUCKETS = (-5.0, -2.0, -1.0, -0.5, -0.25, -0.1, -0.05, 0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)
_TPOT_ERROR_BUCKETS = (-0.2, -0.1, -0.05, -0.02, -0.01, -0.005, 0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 40.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class RouterMetrics:
    def __init__(self, policy: str):
        self.policy = policy
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvfleet_router_requests", "Requests proxied, by replica, policy and final status "
                                "(HTTP code, 'error' for no replica / failed upstream, 'cancelled' for a client "
                                "that went away)", ["replica", "policy", "status"], registry=r)
        self.constrained = Counter("kvfleet_router_constrained_requests", "Requests that ask for constrained "
                                   "decoding, by kind (json_schema, json_object, regex, choice, grammar, tools); "
                                   "passed through to the engines untouched", ["kind"], registry=r)
        self.decisions = Counter("kvfleet_router_routing_decisions", "Routing decisions by reason "
                                 "(cache, adapter, session, least-load, round-robin, all-overloaded)", ["policy", "reason"],
                                 registry=r)
        self.decision_seconds = Histogram("kvfleet_router_routing_decision_seconds", "Time to prepare and route "
                                          "one request (tokenize, hash, score)", buckets=_DECISION_BUCKETS,
                                          registry=r)
        self.predicted_cached = Counter("kvfleet_router_predicted_cached_tokens", "Prompt tokens the router "
                                        "predicted the chosen replica holds, for requests whose usage the engine "
                                        "reported", ["replica"], registry=r)
        self.reported_cached = Counter("kvfleet_router_reported_cached_tokens", "Prompt tokens the engine "
                                       "reported as served from its prefix cache (usage.prompt_tokens_details."
                                       "cached_tokens)", ["replica"], registry=r)
        self.reported_prompt = Counter("kvfleet_router_reported_prompt_tokens", "Prompt tokens the engine "
                                       "reported (usage.prompt_tokens)", ["replica"], registry=r)
        self.prediction_error = Histogram("kvfleet_router_cached_tokens_prediction_error", "|predicted - "
                                          "reported| cached tokens per request", buckets=_TOKEN_BUCKETS, registry=r)
        self.ttft_error = Histogram("kvfleet_router_ttft_prediction_error_seconds", "Observed minus predicted time "
                                    "to first token per request, from the TTFT model fitted online "
                                    "(router/routing/latency_model.py); requests placed before it was ready are left "
                                    "out", buckets=_TTFT_ERROR_BUCKETS, registry=r)
        self.ttft_relative_error = Histogram("kvfleet_router_ttft_prediction_relative_error", "|observed - "
                                             "predicted| / observed time to first token per request (the TTFT "
                                             "model's accuracy; its median is the figure to watch)",
                                             buckets=_RELATIVE_BUCKETS, registry=r)
        self.ttft_predicted = Counter("kvfleet_router_ttft_predicted_requests", "Requests whose first token came "
                                      "with a TTFT prediction made when they were placed", registry=r)
        self.tpot_error = Histogram("kvfleet_router_tpot_prediction_error_seconds", "Observed minus predicted time "
                                    "per output token per streamed request, from the TPOT model fitted online "
                                    "(router/routing/latency_model.py); requests placed before it was ready are left "
                                    "out", buckets=_TPOT_ERROR_BUCKETS, registry=r)
        self.tpot_relative_error = Histogram("kvfleet_router_tpot_prediction_relative_error", "|observed - "
                                             "predicted| / observed time per output token per streamed request (the "
                                             "TPOT model's accuracy; its median is the figure to watch)",
                                             buckets=_RELATIVE_BUCKETS, registry=r)
        self.tpot_predicted = Counter("kvfleet_router_tpot_predicted_requests", "Streamed requests that ended with "
                                      "a TPOT prediction made when they were placed", registry=r)
        self.slo_refused = Counter("kvfleet_router_slo_refused_requests", "Requests with a TTFT or TPOT target (the "
                                   "x-llm-d-slo-ttft-ms / x-llm-d-slo-tpot-ms headers, or the tenant's or pool's) "
                                   "refused with 429 slo_unattainable: no replica of the pool was predicted to meet it",
                                   ["pool"], registry=r)
        self.slo_best_effort = Counter("kvfleet_router_slo_best_effort_requests", "Requests with a target no replica "
                                       "of the pool was predicted to meet, served anyway behind the pool's other "
                                       "requests (the pool's slo_unattainable: best_effort)", ["pool"], registry=r)
        self.slo_ttft = Counter("kvfleet_router_slo_ttft_requests", "Streamed requests with a TTFT target (header, "
                                "tenant's or pool's) by pool, tenant priority ('-': no tenant) and whether their first "
                                "token came within it (attainment: met / (met + missed))",
                                ["pool", "priority", "outcome"], registry=r)
        self.slo_tpot = Counter("kvfleet_router_slo_tpot_requests", "Streamed requests with a TPOT target (header, "
                                "tenant's or pool's) by pool, tenant priority ('-': no tenant) and whether their time "
                                "per output token after the first stayed within it", ["pool", "priority", "outcome"],
                                registry=r)
        self.pulls = Counter("kvfleet_router_kv_pulls", "Requests sent to a replica with a peer to pull their "
                             "cached prefix from (the pulling replica and the source)", ["replica", "source"],
                             registry=r)
        self.pull_tokens = Counter("kvfleet_router_kv_pull_tokens", "Prompt tokens the router expected pulled from "
                                   "a peer rather than prefilled", ["replica"], registry=r)
        self.disagg = Counter("kvfleet_router_disagg_prefills", "Prefills of a decode pool's requests on a prefill "
                              "pool (router/http/disagg.py), by prefill pool and outcome (ok; no_replica, failed, "
                              "refused: the decode replica computed the prompt itself)", ["pool", "outcome"],
                              registry=r)
        self.disagg_prefill_seconds = Histogram("kvfleet_router_disagg_prefill_seconds", "Time of a disaggregated "
                                                "request's prefill on the prefill pool", ["pool"],
                                                buckets=_TTFT_BUCKETS, registry=r)
        self.adapter_loads = Counter("kvfleet_router_adapter_loads", "LoRA adapters this router had a replica "
                                     "load on demand (POST /v1/load_lora_adapter), by pool and outcome (loaded, "
                                     "failed)", ["pool", "outcome"], registry=r)
        self.retries = Counter("kvfleet_router_retries", "Requests retried on another replica before their first "
                               "byte, by reason", ["reason"], registry=r)
        self.migrations = Counter("kvfleet_router_migrations", "Streams whose replica failed after tokens went "
                                  "out, by pool and outcome (completed: it went on on another replica and the "
                                  "client saw one stream; limit: --max-migrations reached; failed: no replica "
                                  "took it, or one refused it; unsupported: it could not go on exactly)",
                                  ["pool", "outcome"], registry=r)
        self.migration_gap = Histogram("kvfleet_router_migration_gap_seconds", "Time between the last chunk a "
                                       "client got from a failed replica and the first one from the replica its "
                                       "stream moved to", ["pool"], buckets=_TTFT_BUCKETS, registry=r)
        self.upstream_failures = Counter("kvfleet_router_upstream_failures", "Failed attempts on a replica, "
                                         "by phase (connect, before-first-byte, mid-stream)", ["replica", "phase"],
                                         registry=r)
        self.kv_resyncs = Counter("kvfleet_router_kv_event_resyncs", "KV event stream resyncs by reason",
                                  ["replica", "reason"], registry=r)
        # tenants and token budgets (router/tenants/ratelimit.py); labelled by tenant name, never by key
        self.ratelimit_requests = Counter("kvfleet_router_ratelimit_requests", "Requests by tenant and admission "
                                          "outcome (admitted, rejected_tokens, rejected_concurrency, too_large, "
                                          "context_too_long, max_tokens_above_cap, shed, unavailable; tenant '-' "
                                          "for unauthorized)", ["tenant", "outcome"], registry=r)
        self.ratelimit_tokens = Counter("kvfleet_router_ratelimit_tokens", "Tokens reserved at admission, used "
                                        "(charged at settlement) and refunded, by tenant", ["tenant", "kind"],
                                        registry=r)
        self.reserved_outstanding = Gauge("kvfleet_router_ratelimit_reserved_tokens", "Tokens reserved by "
                                          "requests in flight, by tenant", ["tenant"], registry=r)
        self.tenant_tokens = Counter("kvfleet_router_tenant_tokens", "Tokens of tenants' settled requests as the "
                                     "engines reported them: prompt tokens computed (of them written to a "
                                     "cache_control breakpoint: written), prompt tokens read from a prefix cache, "
                                     "output tokens; by tenant and model", ["tenant", "model", "kind"],
                                     registry=r)
        self.tenant_cost = Counter("kvfleet_router_tenant_cost_dollars", "What tenants' settled requests cost at "
                                   "the tenants file's prices (US dollars; models with prices only), by tenant and "
                                   "model", ["tenant", "model"], registry=r)
        self.store_errors = Counter("kvfleet_router_ratelimit_store_errors", "Errors of the budget store "
                                    "(Redis)", registry=r)
        self.store_healthy = Gauge("kvfleet_router_ratelimit_store_healthy", "1 while the budget store answers",
                                   registry=r)
        self.store_healthy.set(1)
        self.tenant_reloads = Counter("kvfleet_router_tenants_reloads", "Reloads of the tenants file by result "
                                      "(ok, failed: the previous tenants stay)", ["result"], registry=r)
        # engine pools (router/pools/control.py), labelled by pool, configuration version and model ("-": the
        # model is unknown, so a client cannot grow the label set)
        pv = ["pool", "version", "model"]
        self.pool_requests = Counter("kvfleet_router_pool_requests", "Requests by pool, version and final status "
                                     "(HTTP code, 'error', 'cancelled')", [*pv, "status"], registry=r)
        self.pool_ttft = Histogram("kvfleet_router_pool_ttft_seconds", "Time to first token as the router "
                                   "sees it (streamed requests, from arrival at the router)", pv,
                                   buckets=_TTFT_BUCKETS, registry=r)
        self.pool_tpot = Histogram("kvfleet_router_pool_tpot_seconds", "Time per output token after the "
                                   "first (streamed requests)", pv, buckets=_TPOT_BUCKETS, registry=r)
        self.pool_prompt_tokens = Counter("kvfleet_router_pool_prompt_tokens", "Prompt tokens the engines "
                                          "reported, by pool", pv, registry=r)
        self.pool_cached_tokens = Counter("kvfleet_router_pool_cached_tokens", "Prompt tokens the engines "
                                          "served from their prefix cache, by pool", pv, registry=r)
        self.pool_changes = Counter("kvfleet_router_pool_degradation_changes", "Degradation level changes "
                                    "by pool", ["pool", "from", "to"], registry=r)
        self.pool_no_replica = Counter("kvfleet_router_pool_no_ready_replica", "Requests answered 503 because "
                                       "no replica of the pool was ready (start-up, a rollout): capacity, not the "
                                       "pool's health", pv, registry=r)
        self.pool_lowered = Counter("kvfleet_router_pool_max_tokens_lowered", "Requests whose max_tokens a "
                                    "pool's cap lowered", pv, registry=r)
        # the fair queue in front of full pools (router/admission/gate.py)
        self.queued = Gauge("kvfleet_router_queued_requests", "Requests waiting in the router's fair queue for room "
                            "in their pool (demand the engines have not seen yet), by tenant and the tenant's priority",
                            ["pool", "tenant", "priority"], registry=r)
        self.queue_seconds = Histogram("kvfleet_router_queue_wait_seconds", "Time requests waited in the fair queue "
                                       "before they were sent", ["pool"], buckets=_TTFT_BUCKETS, registry=r)
        self.queue_refused = Counter("kvfleet_router_queue_refusals", "Queued requests that were not sent: "
                                     "full-tenant, full-total (429), timeout (503), cancelled (client gone)",
                                     ["pool", "reason"], registry=r)
        self.pool_reloads = Counter("kvfleet_router_pools_reloads", "Reloads of the pools file by result (ok, "
                                    "failed: the previous pools stay)", ["result"], registry=r)
        self.fleet = None

    def pools_reloaded(self, ok: bool) -> None:
        self.pool_reloads.labels("ok" if ok else "failed").inc()

    def store_error(self, _e: Exception) -> None:
        self.store_errors.inc()
        self.store_healthy.set(0)

    def tenants_reloaded(self, ok: bool) -> None:
        self.tenant_reloads.labels("ok" if ok else "failed").inc()

    def attach(self, fleet) -> None:
        """Export the fleet's per-replica state at scrape time."""
        self.fleet = fleet
        self.registry.register(_FleetCollector(fleet))

    def observe_usage(self, replica: str, predicted: int, usage: dict | None) -> None:
        if not isinstance(usage, dict):
            return
        prompt = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if not isinstance(prompt, int):
            return
        self.reported_prompt.labels(replica).inc(prompt)
        if isinstance(cached, int):
            self.reported_cached.labels(replica).inc(cached)
            self.predicted_cached.labels(replica).inc(predicted)
            self.prediction_error.observe(abs(predicted - cached))

    def attach_pools(self, pools) -> None:
        """Export each pool's weights, degradation level and replica counts at scrape time."""
        self.registry.register(_PoolsCollector(pools))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _FleetCollector:
    def __init__(self, fleet):
        self.fleet = fleet

    def collect(self):
        now = self.fleet.clock()
        circuit = GaugeMetricFamily("kvfleet_router_circuit_state", "1 for the circuit breaker's current state "
                                    "per replica", labels=["replica", "state"])
        ready = GaugeMetricFamily("kvfleet_router_replica_ready", "1 if the replica's last /ready check passed",
                                  labels=["replica"])
        inflight = GaugeMetricFamily("kvfleet_router_inflight_requests", "Requests this router has in flight "
                                     "per replica", labels=["replica"])
        blocks = GaugeMetricFamily("kvfleet_router_indexed_blocks", "Blocks of the replica's prefix cache in "
                                   "the router's exact index", labels=["replica"])
        kv_live = GaugeMetricFamily("kvfleet_router_kv_events_live", "1 if the replica's KV event stream is "
                                    "synced", labels=["replica"])
        count = GaugeMetricFamily("kvfleet_router_replicas", "Replicas known to the router, by state",
                                  labels=["state"])
        n_ready = n_routable = 0
        for url, st in list(self.fleet.replicas.items()):
            state = st.breaker.state(now)
            for s in CircuitState:
                circuit.add_metric([url, s], 1.0 if s == state else 0.0)
            ready.add_metric([url], 1.0 if st.ready else 0.0)
            inflight.add_metric([url], st.inflight)
            blocks.add_metric([url], self.fleet.index.num_blocks(url))
            kv_live.add_metric([url], 1.0 if st.kv_events is KVEventsState.LIVE else 0.0)
            n_ready += st.ready
            n_routable += st.routable(now)
        count.add_metric(["known"], len(self.fleet.replicas))
        count.add_metric(["ready"], n_ready)
        count.add_metric(["routable"], n_routable)
        yield from (circuit, ready, inflight, blocks, kv_live, count)
        placement = self.fleet.placement
        scoring = placement.cfg.scoring
        if scoring.pull_token_cost > 0:
            cost = GaugeMetricFamily("kvfleet_router_pull_token_cost", "The cost of a pulled prompt token in prefill "
                                     "tokens the router routes with (--pull-token-cost, or measured with auto)")
            cost.add_metric([], placement.pull_rates.cost(scoring.pull_token_cost) if scoring.pull_cost_measured
                            else scoring.pull_token_cost)
            yield cost

    def describe(self):
        return []


class _PoolsCollector:
    def __init__(self, pools):
        self.pools = pools

    def collect(self):
        weight = GaugeMetricFamily("kvfleet_router_pool_weight", "Pool weight as configured and in effect (after "
                                   "automatic rollback)", labels=["pool", "version", "kind"])
        level = GaugeMetricFamily("kvfleet_router_pool_degradation_level", "Degradation level: 0 normal, 1 canary "
                                  "rollback, 2 lower max_tokens, 3 shed", labels=["pool", "version"])
        replicas = GaugeMetricFamily("kvfleet_router_pool_replicas", "Replicas of the pool known to the router and "
                                     "ready", labels=["pool", "version", "state"])
        desired = GaugeMetricFamily("kvfleet_router_pool_desired_replicas", "Replicas the pool needs for its "
                                    "requests' TTFT and TPOT targets at the rate they come, as this router's latency "
                                    "models predict and its attainment corrects (router/pools/sizing.py); 0 while "
                                    "no request of the last minute had one", labels=["pool", "version"])
        for p in self.pools.status():
            weight.add_metric([p.name, p.version, "configured"], p.weight)
            weight.add_metric([p.name, p.version, "effective"], p.effective_weight)
            level.add_metric([p.name, p.version], p.level_index)
            replicas.add_metric([p.name, p.version, "known"], p.replicas)
            replicas.add_metric([p.name, p.version, "ready"], p.ready)
            desired.add_metric([p.name, p.version], p.desired)
        yield from (weight, level, replicas, desired)

    def describe(self):
        return []

"""The fleet overview dashboard: capacity, throughput, latency, the prefix cache, errors, budgets and pools.

Fleet-wide series come from the recording rules (dashboards/prometheus/kvfleet-rules.yaml) where one exists;
`$pool` filters the engines' series (a scrape target label; All also matches series without it).
"""

from __future__ import annotations

from dashboards.panels import RATE, Panel, board, datasource_variable, label_variable, q

P = '{pool=~"$pool"}'

CAPACITY = [
    Panel("KV cache usage", "Fraction of KV blocks held by running requests: mean and fullest replica per pool. "
          "The autoscaling signal.",
          (q(f"pool:vllm_kv_cache_usage_perc:avg{P}", "{{pool}} mean"),
           q(f"pool:vllm_kv_cache_usage_perc:max{P}", "{{pool}} fullest")), unit="percentunit", min=0, max=1),
    Panel("Active and waiting sequences", "Sequences in the batch and sequences waiting for it, per pool.",
          (q(f"pool:vllm_num_requests_running:sum{P}", "{{pool}} active"),
           q(f"pool:vllm_num_requests_waiting:sum{P}", "{{pool}} waiting")), min=0),
    Panel("Replicas: desired vs running", "The HPA's desired replicas, the Deployments' wanted and available "
          "replicas (kube-state-metrics), and the engines the routers know and see ready.",
          (q('sum by (horizontalpodautoscaler) (kube_horizontalpodautoscaler_status_desired_replicas'
             '{horizontalpodautoscaler=~".*kvfleet.*"})', "desired {{horizontalpodautoscaler}}"),
           q('sum by (deployment) (kube_deployment_spec_replicas{deployment=~".*kvfleet.*"})',
             "spec {{deployment}}"),
           q('sum by (deployment) (kube_deployment_status_replicas_available{deployment=~".*kvfleet.*"})',
             "available {{deployment}}"),
           q("max by (state) (kvfleet_router_replicas)", "routers: {{state}}")), min=0),
    Panel("GPU memory used (CPU: resident memory)", "Per engine: GPU memory in use (CUDA engines), and the "
          "process's resident memory (what a CPU engine uses).",
          (q(f"sum by (instance) (kvfleet:gpu_memory_used_bytes{P})", "GPU {{instance}}"),
           q('process_resident_memory_bytes{job="kvfleet-engine",pool=~"$pool"}', "resident {{instance}}")),
          unit="bytes", min=0),
    Panel("OOM count", "Engine steps that failed for memory and were recovered, per engine, since it started.",
          (q(f"sum by (instance) (kvfleet:oom_events_total{P})", "{{instance}}"),), min=0),
    Panel("Replicas up", "Scrape targets answering, per job.",
          (q('sum by (job) (up{job=~"kvfleet-engine|kvfleet-router"})', "{{job}}"),), min=0),
]

THROUGHPUT = [
    Panel("Prefill and decode tokens/s", "Prompt tokens processed (prefill; cached ones included), of which "
          "served by the prefix cache, and tokens generated (decode), per pool.",
          (q(f"pool:vllm_prompt_tokens:rate2m{P}", "prefill {{pool}}"),
           q(f"pool:vllm_prefix_cache_hits:rate2m{P}", "prefill from cache {{pool}}"),
           q(f"pool:vllm_generation_tokens:rate2m{P}", "decode {{pool}}")), min=0),
    Panel("TTFT p50 / p95 / p99", "Time to first token, engine-measured, per pool.",
          (q(f"pool:vllm_time_to_first_token_seconds:quantile_rate5m{P}", "q{{quantile}} {{pool}}"),),
          unit="s", min=0),
    Panel("TPOT p50 / p95 / p99", "Time per output token (inter-token latency), engine-measured, per pool.",
          (q(f"pool:vllm_inter_token_latency_seconds:quantile_rate5m{P}", "q{{quantile}} {{pool}}"),),
          unit="s", min=0),
    Panel("Requests/s by status", "Requests the routers answered, by final status.",
          (q(f"sum by (status) (rate(kvfleet_router_requests_total[{RATE}]))", "{{status}}"),),
          unit="reqps", min=0),
    Panel("Preemptions/s", "Requests preempted for lack of KV blocks (recomputed later), per pool.",
          (q(f"sum by (pool) (rate(vllm:num_preemptions_total{P}[{RATE}]))", "{{pool}}"),), min=0),
    Panel("Routing decisions by reason", "Why the routers chose a replica: cache hit, session, least load, "
          "all overloaded, ...",
          (q(f"sum by (reason) (rate(kvfleet_router_routing_decisions_total[{RATE}]))", "{{reason}}"),),
          unit="reqps", min=0),
]

CACHE = [
    Panel("Cache hit ratio", "Prompt tokens served by the prefix cache: engines per pool, and on the requests "
          "the routers saw, the hit ratio they predicted next to the one the engines reported.",
          (q(f"pool:vllm_prefix_cache_hit_ratio:rate5m{P}", "engines {{pool}}"),
           q("kvfleet_router:predicted_hit_ratio:rate5m", "router predicted"),
           q("kvfleet_router:reported_hit_ratio:rate5m", "engine reported")), unit="percentunit", min=0, max=1),
    Panel("Predicted vs reported cached tokens/s", "Cached prompt tokens the routers predicted and the engines "
          "reported (usage.prompt_tokens_details.cached_tokens), and all prompt tokens reported.",
          (q(f"sum(rate(kvfleet_router_predicted_cached_tokens_total[{RATE}]))", "predicted cached"),
           q(f"sum(rate(kvfleet_router_reported_cached_tokens_total[{RATE}]))", "reported cached"),
           q(f"sum(rate(kvfleet_router_reported_prompt_tokens_total[{RATE}]))", "reported prompt")), min=0),
    Panel("Block allocation failures and evictions/s", "KV block allocations that found no free block, and "
          "cached blocks evicted to be reused, per pool.",
          (q(f"sum by (pool) (rate(kvfleet:block_allocation_failures_total{P}[{RATE}]))",
             "allocation failures {{pool}}"),
           q(f"sum by (pool) (rate(kvfleet:block_evictions_total{P}[{RATE}]))", "evictions {{pool}}")), min=0),
    Panel("KV moved between replicas and tiers", "Blocks/s pulled from peers (imports), taken by the lower tier "
          "(spills) and brought back from it (reloads), per pool.",
          (q(f'sum by (pool) (rate(kvfleet:kv_transfer_blocks_total{{direction="import",pool=~"$pool"}}[{RATE}]))',
             "pulled {{pool}}"),
           q(f"sum by (pool) (rate(kvfleet:kv_tier_spilled_blocks_total{P}[{RATE}]))", "to tier {{pool}}"),
           q(f"sum by (pool) (rate(kvfleet:kv_tier_reloaded_blocks_total{P}[{RATE}]))", "from tier {{pool}}")),
          min=0),
    Panel("Pull outcomes and disaggregated prefills", "Engines' pulls by outcome, and the routers' prefills of "
          "decode pools' requests on prefill pools by outcome.",
          (q(f"sum by (outcome) (rate(kvfleet:kv_pulls_total{P}[{RATE}]))", "pull {{outcome}}"),
           q(f"sum by (pool, outcome) (rate(kvfleet_router_disagg_prefills_total[{RATE}]))",
             "prefill {{outcome}} {{pool}}")), unit="reqps", min=0),
]

ERRORS = [
    Panel("Request cancellation rate", "Share of requests whose client went away (routers), and of engine "
          "requests aborted (client gone, drain timeout, error).",
          (q(f'sum(rate(kvfleet_router_requests_total{{status="cancelled"}}[{RATE}])) '
             f"/ sum(rate(kvfleet_router_requests_total[{RATE}]))", "cancelled (routers)"),
           q(f"sum(rate(kvfleet:aborted_requests_total{P}[{RATE}])) "
             f"/ sum(rate(vllm:request_success_total{P}[{RATE}]))", "aborted (engines)")),
          unit="percentunit", min=0),
    Panel("Errors by type", "Router answers other than 2xx (HTTP code, 'error': no replica or failed "
          "upstream), upstream failures by phase, retries by reason, engine rejections by status.",
          (q(f'sum by (status) (rate(kvfleet_router_requests_total{{status!~"2..|cancelled"}}[{RATE}]))',
             "router {{status}}"),
           q(f"sum by (phase) (rate(kvfleet_router_upstream_failures_total[{RATE}]))", "upstream {{phase}}"),
           q(f"sum by (reason) (rate(kvfleet_router_retries_total[{RATE}]))", "retry {{reason}}"),
           q(f"sum by (status) (rate(kvfleet:rejected_requests_total{P}[{RATE}]))", "engine {{status}}")),
          unit="reqps", min=0),
    Panel("Streams moved to another replica", "Streams whose replica failed after tokens went out, by pool and "
          "outcome (completed: the client saw one stream; limit, failed, unsupported: it ended with an error "
          "event), and the pause their clients saw at the break (p50, p99).",
          (q(f"sum by (pool, outcome) (rate(kvfleet_router_migrations_total[{RATE}]))", "{{pool}} {{outcome}}/s"),
           q(f"histogram_quantile(0.5, sum by (pool, le) (rate(kvfleet_router_migration_gap_seconds_bucket[{RATE}])))",
             "gap p50 {{pool}} (s)"),
           q(f"histogram_quantile(0.99, sum by (pool, le) (rate(kvfleet_router_migration_gap_seconds_bucket[{RATE}])))",
             "gap p99 {{pool}} (s)")), min=0),
    Panel("Rate-limit rejections per tenant", "Requests the token budgets refused, by tenant and outcome "
          "(rejected_tokens, rejected_concurrency, too_large, shed, unauthorized, ...).",
          (q(f'sum by (tenant, outcome) (rate(kvfleet_router_ratelimit_requests_total{{outcome!="admitted"}}'
             f"[{RATE}]))", "{{tenant}} {{outcome}}"),), unit="reqps", min=0),
    Panel("Queued for room, per tenant", "Requests the routers hold in their fair queues because the pool is "
          "full (--replica-slots), by tenant and the tenant's priority: demand the engines have not seen yet.",
          (q("sum by (pool, tenant, priority) (kvfleet_router_queued_requests)", "{{pool}} {{tenant}} p{{priority}}"),),
          min=0),
    Panel("Queue wait p99 and refusals", "How long requests waited in the fair queue (p99, per pool), and the "
          "queued requests not sent: full (429), timeout (503), cancelled.",
          (q(f"histogram_quantile(0.99, sum by (pool, le) (rate(kvfleet_router_queue_wait_seconds_bucket[{RATE}])))",
             "wait p99 {{pool}}"),
           q(f"sum by (pool, reason) (rate(kvfleet_router_queue_refusals_total[{RATE}]))", "{{pool}} {{reason}}/s")),
          min=0),
    Panel("Rate-limiter store", "Budget store (Redis) errors per router, and whether it answers (1).",
          (q(f"sum by (instance) (rate(kvfleet_router_ratelimit_store_errors_total[{RATE}]))",
             "errors/s {{instance}}"),
           q("min by (instance) (kvfleet_router_ratelimit_store_healthy)", "healthy {{instance}}")), min=0),
]

POOLS = [
    Panel("Requests/s per pool", "Requests the routers sent to each pool and configuration version.",
          (q("pool_version_model:kvfleet_router_pool_requests:rate2m", "{{pool}} {{version}} {{model}}"),), unit="reqps", min=0),
    Panel("Error ratio per pool", "Share of a pool's requests answered 5xx or failed.",
          (q("pool_version_model:kvfleet_router_pool_error_ratio:rate5m", "{{pool}} {{version}} {{model}}"),),
          unit="percentunit", min=0),
    Panel("TTFT p99 per pool", "Time to first token p99 as the routers measure it, per pool and version.",
          (q("pool_version_model:kvfleet_router_pool_ttft_seconds:quantile_rate5m", "{{pool}} {{version}} {{model}}"),),
          unit="s", min=0),
    Panel("TPOT p99 per pool", "Time per output token p99 as the routers measure it, per pool and version.",
          (q("pool_version_model:kvfleet_router_pool_tpot_seconds:quantile_rate5m", "{{pool}} {{version}} {{model}}"),),
          unit="s", min=0),
    Panel("Latency target attainment", "Share of streamed requests with a TTFT target (x-llm-d-slo-ttft-ms, or "
          "their tenant's or pool's slo_ttft_ms) whose first token came within it, and with a TPOT target "
          "(x-llm-d-slo-tpot-ms, slo_tpot_ms) whose later tokens came within it, per pool and tenant priority; and "
          "requests refused 429 slo_unattainable because no replica was predicted to meet theirs.",
          (q(f'sum by (pool, priority) (rate(kvfleet_router_slo_ttft_requests_total{{outcome="met"}}[{RATE}])) / '
             f"sum by (pool, priority) (rate(kvfleet_router_slo_ttft_requests_total[{RATE}]))",
             "TTFT met {{pool}} p{{priority}}"),
           q(f'sum by (pool, priority) (rate(kvfleet_router_slo_tpot_requests_total{{outcome="met"}}[{RATE}])) / '
             f"sum by (pool, priority) (rate(kvfleet_router_slo_tpot_requests_total[{RATE}]))",
             "TPOT met {{pool}} p{{priority}}"),
           q(f"sum by (pool) (rate(kvfleet_router_slo_refused_requests_total[{RATE}]))", "refused/s {{pool}}")),
          min=0),
    Panel("Latency prediction error", "Observed minus predicted time to first token and time per output token "
          "(the router's TTFT and TPOT models, fitted online): median and p90 of each error; near 0 when the "
          "models are right.",
          (q(f"histogram_quantile(0.5, sum by (le) (rate(kvfleet_router_ttft_prediction_error_seconds_bucket[{RATE}])))",
             "TTFT median"),
           q(f"histogram_quantile(0.9, sum by (le) (rate(kvfleet_router_ttft_prediction_error_seconds_bucket[{RATE}])))",
             "TTFT p90"),
           q(f"histogram_quantile(0.5, sum by (le) (rate(kvfleet_router_tpot_prediction_error_seconds_bucket[{RATE}])))",
             "TPOT median"),
           q(f"histogram_quantile(0.9, sum by (le) (rate(kvfleet_router_tpot_prediction_error_seconds_bucket[{RATE}])))",
             "TPOT p90")), unit="s"),
    Panel("Cache hit ratio per pool", "Cached / prompt tokens the engines reported, per pool and version.",
          (q("pool_version_model:kvfleet_router_pool_hit_ratio:rate5m", "{{pool}} {{version}} {{model}}"),),
          unit="percentunit", min=0, max=1),
    Panel("Pool weights", "Configured and effective (after degradation) share of new sessions.",
          (q("max by (pool, version, kind) (kvfleet_router_pool_weight)", "{{pool}} {{version}} {{kind}}"),),
          min=0),
    Panel("Degradation level", "0 normal, 1 canary rolled back, 2 max_tokens lowered, 3 shedding.",
          (q("max by (pool, version) (kvfleet_router_pool_degradation_level)", "{{pool}} {{version}}"),),
          min=0, max=3),
    Panel("Pool replicas", "Engines per pool the routers know and see ready, and the replicas the routers predict "
          "the pool's latency targets need (the most any router says; 0 while no request had a target).",
          (q("max by (pool, version, state) (kvfleet_router_pool_replicas)", "{{pool}} {{version}} {{state}}"),
           q("max by (pool, version) (kvfleet_router_pool_desired_replicas)", "{{pool}} {{version}} desired")),
          min=0),
    Panel("Degradation changes and max_tokens lowered", "Level changes per pool, and requests whose max_tokens "
          "the router lowered.",
          (q(f"sum by (pool, from, to) (increase(kvfleet_router_pool_degradation_changes_total[{RATE}]))",
             "{{pool}} {{from}} -> {{to}}"),
           q(f"sum by (pool, version, model) (rate(kvfleet_router_pool_max_tokens_lowered_total[{RATE}]))",
             "lowered/s {{pool}} {{version}} {{model}}")), min=0),
]


def fleet_dashboard():
    return board("kvfleet-fleet", "kvfleet / Fleet overview",
                 "The whole fleet: KV capacity, throughput, latency, prefix cache, errors, budgets and pools.",
                 [datasource_variable(), label_variable("pool", "Pool", "vllm:num_requests_running")],
                 [("Capacity", CAPACITY), ("Throughput and latency", THROUGHPUT), ("Prefix cache", CACHE),
                  ("Errors, cancellations and budgets", ERRORS), ("Pools: stable vs canary", POOLS)])

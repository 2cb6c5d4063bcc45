"""The per-replica dashboard: one engine (or several, `$instance`) in detail, and the routers' view of it.

Engines are told apart by their scrape `instance` (host:port); the routers label the same engine by its URL
(`replica`), matched here as `https?://$instance`.
"""

from __future__ import annotations

from dashboards.panels import RATE, Panel, board, datasource_variable, label_variable, q

INST = '{instance=~"$instance"}'
REPL = '{replica=~"https?://($instance)"}'


def _quantiles(metric: str) -> tuple:
    return tuple(q(f"histogram_quantile({x}, sum by (instance, le) (rate({metric}_bucket{INST}[{RATE}])))",
                   f"p{label} {{{{instance}}}}") for x, label in ((0.5, "50"), (0.95, "95"), (0.99, "99")))


ENGINE = [
    Panel("KV cache usage", "Fraction of this replica's KV blocks held by running requests.",
          (q(f"vllm:kv_cache_usage_perc{INST}", "{{instance}}"),), unit="percentunit", min=0, max=1),
    Panel("Active and waiting sequences", "Sequences in the batch and waiting for it.",
          (q(f"vllm:num_requests_running{INST}", "active {{instance}}"),
           q(f"vllm:num_requests_waiting{INST}", "waiting {{instance}}")), min=0),
    Panel("Prefill and decode tokens/s", "Prompt tokens processed (cached ones included), of which from the "
          "prefix cache, and tokens generated.",
          (q(f"sum by (instance) (rate(vllm:prompt_tokens_total{INST}[{RATE}]))", "prefill {{instance}}"),
           q(f"sum by (instance) (rate(vllm:prefix_cache_hits_total{INST}[{RATE}]))", "prefill from cache {{instance}}"),
           q(f"sum by (instance) (rate(vllm:generation_tokens_total{INST}[{RATE}]))", "decode {{instance}}")), min=0),
    Panel("TTFT p50 / p95 / p99", "Time to first token.", _quantiles("vllm:time_to_first_token_seconds"),
          unit="s", min=0),
    Panel("TPOT p50 / p95 / p99", "Time per output token (inter-token latency).",
          _quantiles("vllm:inter_token_latency_seconds"), unit="s", min=0),
    Panel("Queue time and end-to-end latency p99", "Time before first scheduled, and whole-request latency.",
          (q(f"histogram_quantile(0.99, sum by (instance, le) (rate(vllm:request_queue_time_seconds_bucket{INST}"
             f"[{RATE}])))", "queue p99 {{instance}}"),
           q(f"histogram_quantile(0.99, sum by (instance, le) (rate(vllm:e2e_request_latency_seconds_bucket{INST}"
             f"[{RATE}])))", "end-to-end p99 {{instance}}")), unit="s", min=0),
    Panel("Cache hit ratio", "Prompt tokens served by the prefix cache / prompt tokens looked up.",
          (q(f"sum by (instance) (rate(vllm:prefix_cache_hits_total{INST}[{RATE}])) "
             f"/ sum by (instance) (rate(vllm:prefix_cache_queries_total{INST}[{RATE}]))", "{{instance}}"),),
          unit="percentunit", min=0, max=1),
    Panel("Block allocation failures and evictions/s", "Allocations that found no free block; cached blocks "
          "evicted to be reused.",
          (q(f"sum by (instance) (rate(kvfleet:block_allocation_failures_total{INST}[{RATE}]))",
             "allocation failures {{instance}}"),
           q(f"sum by (instance) (rate(kvfleet:block_evictions_total{INST}[{RATE}]))", "evictions {{instance}}")),
          min=0),
    Panel("Preemptions/s", "Requests preempted for lack of KV blocks.",
          (q(f"sum by (instance) (rate(vllm:num_preemptions_total{INST}[{RATE}]))", "{{instance}}"),), min=0),
    Panel("OOM count", "Engine steps that failed for memory and were recovered, since start.",
          (q(f"sum by (instance) (kvfleet:oom_events_total{INST})", "{{instance}}"),), min=0),
    Panel("GPU memory used (CPU: resident memory)", "GPU memory in use (CUDA engines), and resident memory.",
          (q(f"sum by (instance) (kvfleet:gpu_memory_used_bytes{INST})", "GPU {{instance}}"),
           q('process_resident_memory_bytes{job="kvfleet-engine",instance=~"$instance"}',
             "resident {{instance}}")), unit="bytes", min=0),
    Panel("Request cancellation rate", "Aborted requests (client gone, drain timeout, error) / finished.",
          (q(f"sum by (instance) (rate(kvfleet:aborted_requests_total{INST}[{RATE}])) "
             f"/ sum by (instance) (rate(vllm:request_success_total{INST}[{RATE}]))", "{{instance}}"),),
          unit="percentunit", min=0),
    Panel("Finished requests by reason", "stop, length, abort.",
          (q(f"sum by (instance, finished_reason) (rate(vllm:request_success_total{INST}[{RATE}]))",
             "{{finished_reason}} {{instance}}"),), unit="reqps", min=0),
    Panel("Rejected requests by status", "Requests refused before running (400, 404, 413, 429, 503).",
          (q(f"sum by (instance, status) (rate(kvfleet:rejected_requests_total{INST}[{RATE}]))",
             "{{status}} {{instance}}"),), unit="reqps", min=0),
    Panel("KV blocks and events", "KV blocks in total, and KV cache events published per second.",
          (q(f"kvfleet:num_kv_blocks{INST}", "blocks {{instance}}"),
           q(f"sum by (instance) (rate(kvfleet:kv_events_published_total{INST}[{RATE}]))",
             "events/s {{instance}}")), min=0),
]

TRANSFERS = [
    Panel("KV pulls by outcome", "Requests that pulled their cached prefix from a peer before they were queued: "
          "pulled (all of it), partial, none (the peer held none), held (this replica had it), joined (waited for "
          "another request's pull), and the failures: refused, failed, timeout, invalid.",
          (q(f"sum by (instance, outcome) (rate(kvfleet:kv_pulls_total{INST}[{RATE}]))",
             "{{outcome}} {{instance}}"),), unit="reqps", min=0),
    Panel("KV transfer bytes/s", "KV payload this replica sent to peers (export) and took from them (import).",
          (q(f"sum by (instance, direction) (rate(kvfleet:kv_transfer_bytes_total{INST}[{RATE}]))",
             "{{direction}} {{instance}}"),), unit="Bps", min=0),
    Panel("KV pull time p50 / p99", "Time a request spent pulling its prefix before it was queued.",
          (q(f"histogram_quantile(0.5, sum by (instance, le) (rate(kvfleet:kv_pull_seconds_bucket{INST}[{RATE}])))",
             "p50 {{instance}}"),
           q(f"histogram_quantile(0.99, sum by (instance, le) (rate(kvfleet:kv_pull_seconds_bucket{INST}[{RATE}])))",
             "p99 {{instance}}")), unit="s", min=0),
    Panel("Lower KV tier", "Blocks the lower tier holds (--kv-tier-gib), and blocks/s it takes from the KV cache "
          "and gives back.",
          (q(f"kvfleet:kv_tier_blocks{INST}", "held {{instance}}"),
           q(f"sum by (instance) (rate(kvfleet:kv_tier_spilled_blocks_total{INST}[{RATE}]))", "in/s {{instance}}"),
           q(f"sum by (instance) (rate(kvfleet:kv_tier_reloaded_blocks_total{INST}[{RATE}]))",
             "back/s {{instance}}")), min=0),
    Panel("KV import refusals by reason", "Blocks or streams a peer offered that failed the checks (hash, tokens, "
          "layout, size, adapter, stream): the request computed them instead.",
          (q(f"sum by (instance, reason) (rate(kvfleet:kv_import_refusals_total{INST}[{RATE}]))",
             "{{reason}} {{instance}}"),), min=0),
]

SPECULATION = [
    Panel("Drafts kept", "Of the draft tokens verified, the share kept (engines with --speculative-config), "
          "overall and by position among a step's drafts (0: the first).",
          (q(f"sum by (instance) (rate(vllm:spec_decode_num_accepted_tokens_total{INST}[{RATE}])) "
             f"/ sum by (instance) (rate(vllm:spec_decode_num_draft_tokens_total{INST}[{RATE}]))", "all {{instance}}"),
           q(f"sum by (instance, position) (rate(vllm:spec_decode_num_accepted_tokens_per_pos_total{INST}[{RATE}])) "
             f"/ on (instance) group_left sum by (instance) (rate(vllm:spec_decode_num_drafts_total{INST}[{RATE}]))",
             "position {{position}} {{instance}}")), unit="percentunit", min=0, max=1),
    Panel("Verifications and tokens per verification", "Sequences verified with drafts per second, and the "
          "tokens each such verification produced (kept drafts + the token sampled after them).",
          (q(f"sum by (instance) (rate(vllm:spec_decode_num_drafts_total{INST}[{RATE}]))", "verifications/s {{instance}}"),
           q(f"(sum by (instance) (rate(vllm:spec_decode_num_accepted_tokens_total{INST}[{RATE}])) "
             f"+ sum by (instance) (rate(vllm:spec_decode_num_drafts_total{INST}[{RATE}]))) "
             f"/ sum by (instance) (rate(vllm:spec_decode_num_drafts_total{INST}[{RATE}]))",
             "tokens per verification {{instance}}")), min=0),
    Panel("Speculation gate", "1 while drafting pays on this engine's steps (0: off but for probes); the gate's "
          "estimate of a drafting step's speed over a step without drafts; steps it kept undrafted per second.",
          (q(f"max by (instance) (kvfleet:spec_decode_gate_open{INST})", "open {{instance}}"),
           q(f"max by (instance) (kvfleet:spec_decode_gate_speedup{INST})", "speed-up {{instance}}"),
           q(f"sum by (instance) (rate(kvfleet:spec_decode_gate_closed_steps_total{INST}[{RATE}]))",
             "closed steps/s {{instance}}")), min=0),
]

ROUTERS = [
    Panel("Router requests by status", "Requests the routers sent to this replica, by final status.",
          (q(f"sum by (replica, status) (rate(kvfleet_router_requests_total{REPL}[{RATE}]))", "{{status}} {{replica}}"),),
          unit="reqps", min=0),
    Panel("In flight from the routers", "Requests the routers have in flight to this replica.",
          (q(f"sum by (replica) (kvfleet_router_inflight_requests{REPL})", "{{replica}}"),), min=0),
    Panel("Predicted vs reported cached tokens/s", "For this replica's requests: cached tokens the routers "
          "predicted and the engine reported.",
          (q(f"sum by (replica) (rate(kvfleet_router_predicted_cached_tokens_total{REPL}[{RATE}]))",
             "predicted {{replica}}"),
           q(f"sum by (replica) (rate(kvfleet_router_reported_cached_tokens_total{REPL}[{RATE}]))",
             "reported {{replica}}")), min=0),
    Panel("Readiness and circuit", "1 when ready in every router's checks; circuit breakers not closed.",
          (q(f"min by (replica) (kvfleet_router_replica_ready{REPL})", "ready {{replica}}"),
           q('max by (replica, state) (kvfleet_router_circuit_state{replica=~"https?://($instance)",'
             'state!="closed"})', "{{state}} {{replica}}")), min=0, max=1),
    Panel("Routers' KV index", "Blocks of this replica's cache in the routers' index; 1 when its KV event "
          "stream is live in every router.",
          (q(f"max by (replica) (kvfleet_router_indexed_blocks{REPL})", "blocks {{replica}}"),
           q(f"min by (replica) (kvfleet_router_kv_events_live{REPL})", "events live {{replica}}")), min=0),
    Panel("Pulls the routers asked for", "Requests sent to this replica with a peer to pull their prefix from, "
          "and the prompt tokens expected to arrive so.",
          (q(f"sum by (replica) (rate(kvfleet_router_kv_pulls_total{REPL}[{RATE}]))", "pulls {{replica}}"),
           q(f"sum by (replica) (rate(kvfleet_router_kv_pull_tokens_total{REPL}[{RATE}]))",
             "tokens {{replica}}")), min=0),
]


def replica_dashboard():
    return board("kvfleet-replica", "kvfleet / Replica",
                 "One engine replica in detail (choose it with $instance), and the routers' view of it.",
                 [datasource_variable(), label_variable("instance", "Replica", "vllm:num_requests_running")],
                 [("Engine", ENGINE), ("KV transfers between replicas", TRANSFERS),
                  ("Speculative decoding", SPECULATION), ("The routers' view of this replica", ROUTERS)])

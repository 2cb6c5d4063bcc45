"""Prometheus metrics of one engine replica, under vLLM's names (plus kvfleet's own).

One `EngineMetrics` (and one registry) per process. Engine-wide state (KV usage, queue lengths,
prefix-cache and token counters, preemptions, allocation failures, evictions, out-of-memory steps, KV
events, GPU memory in use on CUDA) is read from `engine.stats()` at scrape time by a custom collector, so it
can never drift from the engine. prometheus_client's ProcessCollector adds the standard `process_*`
metrics (resident memory, CPU seconds, open file descriptors).
Per-request latencies (TTFT, inter-token, end-to-end, queue time) and outcomes are observed by the
server as outputs arrive, through `RequestTimer`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.process_collector import ProcessCollector

from contract.kv_transfer import PullOutcome, Refusal

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
QUEUE_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                 80.0, 160.0, 320.0, 640.0)
FINISH_REASONS = ("stop", "length", "abort")

# (exported name without _total, EngineStats attribute, help)
_COUNTERS = (
    ("vllm:prefix_cache_queries", "prefix_queries_tokens", "Prompt tokens looked up in the prefix cache."),
    ("vllm:prefix_cache_hits", "prefix_hits_tokens", "Prompt tokens served by the prefix cache."),
    ("vllm:num_preemptions", "num_preemptions", "Requests preempted (recomputed later) for lack of KV blocks."),
    ("vllm:prompt_tokens", "prompt_tokens_total", "Prompt tokens processed (prefilled or cached)."),
    ("vllm:generation_tokens", "generation_tokens_total", "Tokens generated."),
    ("kvfleet:block_allocation_failures", "alloc_failures", "KV block allocations that found no free block."),
    ("kvfleet:block_evictions", "evictions", "Cached KV blocks evicted from the prefix cache to be reused."),
    ("kvfleet:kv_events_published", "kv_events_published", "KV cache events (stored/removed/cleared) published."),
    ("kvfleet:kv_tier_spilled_blocks", "tier_spilled_blocks", "Blocks evicted from the KV cache that the lower "
     "tier took (--kv-tier-gib)."),
    ("kvfleet:kv_tier_reloaded_blocks", "tier_reloaded_blocks", "Blocks brought back from the lower tier into the "
     "KV cache instead of being prefilled again."),
    ("kvfleet:oom_events", "oom_events", "Steps that ran out of memory and were recovered (retried smaller)."),
    ("kvfleet:steps_predicted", "steps_predicted", "Steps the fitted step-time model predicted (--max-step-ms)."),
    ("kvfleet:step_predicted_seconds", "step_predicted_seconds_total", "Seconds the step-time model predicted for "
     "the steps it predicted."),
    ("kvfleet:step_observed_seconds", "step_observed_seconds_total", "Seconds the steps the step-time model "
     "predicted took (against kvfleet:step_predicted_seconds: the model's bias)."),
    ("kvfleet:step_prediction_error_seconds", "step_prediction_error_seconds_total", "Sum of |predicted - taken| "
     "over the predicted steps (over kvfleet:steps_predicted: the mean error)."),
)
_GAUGES = (
    ("vllm:kv_cache_usage_perc", "kv_usage", "KV cache usage: fraction of blocks held by requests (0..1)."),
    ("vllm:num_requests_running", "num_running", "Requests running (in the batch)."),
    ("vllm:num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
    ("kvfleet:num_kv_blocks", "num_total_blocks", "KV cache blocks in total."),
    ("kvfleet:num_free_kv_blocks", "num_free_blocks", "KV cache blocks no request holds (cached ones among them)."),
    ("kvfleet:kv_tier_blocks", "tier_blocks", "Blocks the lower KV tier holds (0 without one)."),
    ("kvfleet:kv_tier_bytes", "tier_bytes", "Bytes the lower KV tier holds."),
    ("kvfleet:step_seconds", "step_seconds", "Wall time of the last engine step (schedule to sampled tokens)."),
    ("kvfleet:step_predicted_seconds_last", "step_predicted_seconds", "The step-time model's prediction for the last "
     "step (0 until it is fitted)."),
    ("kvfleet:kv_pinned_blocks", "num_pinned_blocks", "KV cache blocks that cache_control prefixes keep from "
     "eviction until their TTL passes (--kv-pin-fraction)."),
    ("kvfleet:num_cached_kv_blocks", "num_cached_blocks", "KV cache blocks whose content the prefix cache holds "
     "(held or free): what the KV events announce."),
)


class _StatsCollector:
    """Reads engine.stats() on every scrape; before the engine is up every value reads 0."""

    def __init__(self, model_name: str, stats: Callable[[], object | None], extra_info: Callable[[], dict]):
        self.model_name = model_name
        self.stats = stats
        self.extra_info = extra_info

    def describe(self):
        return []  # collected lazily; registering must not call the engine

    def collect(self):
        try:
            s = self.stats()
        except Exception:  # a scrape must never fail because the engine is busy or shutting down
            s = None
        labels = [self.model_name]
        for name, attr, help_text in _COUNTERS:
            c = CounterMetricFamily(name, help_text, labels=["model_name"])
            c.add_metric(labels, float(getattr(s, attr, 0) or 0))
            yield c
        for name, attr, help_text in _GAUGES:
            g = GaugeMetricFamily(name, help_text, labels=["model_name"])
            g.add_metric(labels, float(getattr(s, attr, 0) or 0))
            yield g
        gpu_bytes = getattr(s, "gpu_memory_used_bytes", None)
        if gpu_bytes is not None:  # only an engine on CUDA has it
            g = GaugeMetricFamily("kvfleet:gpu_memory_used_bytes", "GPU memory held by tensors of this engine "
                                  "(torch.cuda.memory_allocated).", labels=["model_name"])
            g.add_metric(labels, float(gpu_bytes))
            yield g
        g = GaugeMetricFamily("kvfleet:deterministic", "1 when the engine runs --deterministic (a request's tokens "
                              "and logprobs independent of its batch and of the cache), else 0.", labels=["model_name"])
        g.add_metric(labels, 1.0 if getattr(s, "deterministic", False) else 0.0)
        yield g
        yield from _spec_decode(s, labels)
        max_loras = getattr(s, "max_loras", 0)
        if max_loras:  # vLLM's gauge with LoRA enabled: the value is the time of the reading
            g = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.",
                                  labels=["running_lora_adapters", "max_lora", "waiting_lora_adapters"])
            g.add_metric([",".join(s.lora_running), str(max_loras), ",".join(s.lora_waiting)], time.time())
            yield g
        info = {"model_name": self.model_name, "block_size": str(getattr(s, "block_size", "") or ""),
                "num_gpu_blocks": str(getattr(s, "num_total_blocks", "") or ""), "enable_prefix_caching": "True"}
        info.update({k: str(v) for k, v in self.extra_info().items()})
        g = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache configuration.",
                              labels=list(info))
        g.add_metric(list(info.values()), 1.0)
        yield g


_SPEC_COUNTERS = (
    ("vllm:spec_decode_num_drafts", "spec_num_drafts", "Verifications of a sequence with draft tokens."),
    ("vllm:spec_decode_num_draft_tokens", "spec_num_draft_tokens", "Draft tokens verified."),
    ("vllm:spec_decode_num_accepted_tokens", "spec_num_accepted_tokens", "Draft tokens accepted."),
)


def _spec_decode(s, labels: list[str]):
    """vLLM's spec_decode counters, on an engine with --speculative-config only (engine/spec/)."""
    per_pos = getattr(s, "spec_accepted_per_pos", ())
    if not per_pos:
        return
    for name, attr, help_text in _SPEC_COUNTERS:
        c = CounterMetricFamily(name, help_text, labels=["model_name"])
        c.add_metric(labels, float(getattr(s, attr, 0)))
        yield c
    c = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by their "
                            "position among a step's drafts (0: the first).", labels=["model_name", "position"])
    for pos, n in enumerate(per_pos):
        c.add_metric([*labels, str(pos)], float(n))
    yield c
    g = GaugeMetricFamily("kvfleet:spec_decode_gate_open", "1 while drafting pays on steps of the last step's "
                          "batch-size class, 0 while the gate keeps it off there but for probe steps "
                          "(engine/spec/draft_gate.py).", labels=["model_name"])
    g.add_metric(labels, 1.0 if getattr(s, "spec_gate_open", True) else 0.0)
    yield g
    speedup = getattr(s, "spec_gate_speedup", None)
    if speedup is not None:
        g = GaugeMetricFamily("kvfleet:spec_decode_gate_speedup", "The gate's moving estimate of a drafting step's "
                              "tokens per second over a step without drafts, for the last step's batch-size class "
                              "(below 1 it closes).",
                              labels=["model_name"])
        g.add_metric(labels, float(speedup))
        yield g
    c = CounterMetricFamily("kvfleet:spec_decode_gate_closed_steps", "Steps that did not draft because the gate "
                            "was closed.", labels=["model_name"])
    c.add_metric(labels, float(getattr(s, "spec_gate_closed_steps", 0)))
    yield c


class EngineMetrics:
    def __init__(self, model_name: str, stats: Callable[[], object | None] = lambda: None,
                 extra_info: Callable[[], dict] = dict):
        disable_created_metrics()  # *_created series only double the scrape size
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, lab = self.registry, ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", lab,
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive output steps of a request.",
                             lab, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", lab,
                             buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time a request waited before first scheduled.",
                               lab, buckets=QUEUE_BUCKETS, registry=r).labels(model_name)
        success = Counter("vllm:request_success", "Finished requests by finish reason.",
                          ["model_name", "finished_reason"], registry=r)
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self.aborted = Counter("kvfleet:aborted_requests", "Requests aborted (client gone, drain timeout, error).",
                               lab, registry=r).labels(model_name)
        self.rejected = Counter("kvfleet:rejected_requests", "Requests rejected before running, by HTTP status.",
                                ["model_name", "status"], registry=r)
        for status in ("400", "404", "413", "503"):  # exported from the start, at 0
            self.rejected.labels(model_name, status)
        # measured rates (the router's --pull-token-cost auto compares them): prefill seconds per computed prompt
        # token, from each request's first scheduling to its first token, and pull seconds per pulled token
        self.prefill_seconds = Counter("kvfleet:prefill_seconds", "Seconds requests spent from their first "
                                       "scheduling to their first token (their prefill, sharing steps with others).",
                                       lab, registry=r).labels(model_name)
        self.prefill_tokens = Counter("kvfleet:prefill_computed_tokens", "Prompt tokens those requests computed "
                                      "(not found in the prefix cache).", lab, registry=r).labels(model_name)
        self.kv_pull_transfer_seconds = Counter("kvfleet:kv_pull_transfer_seconds", "Seconds pulls that took blocks "
                                                "spent moving them (their time less the source's waits for its "
                                                "prefill).", lab, registry=r).labels(model_name)
        self.kv_pulled_tokens = Counter("kvfleet:kv_pulled_tokens", "Prompt tokens pulled from peers (blocks "
                                        "imported × block size).", lab, registry=r).labels(model_name)
        # KV blocks between engines (engine/server/kv_transfer.py)
        self.kv_blocks = Counter("kvfleet:kv_transfer_blocks", "KV blocks sent to peers (export) or taken from "
                                 "them (import).", ["model_name", "direction"], registry=r)
        self.kv_bytes = Counter("kvfleet:kv_transfer_bytes", "KV payload bytes sent to peers (export) or taken "
                                "from them (import).", ["model_name", "direction"], registry=r)
        self.kv_pulls = Counter("kvfleet:kv_pulls", "Prefix pulls from a peer, by outcome (pulled, partial, none, "
                                "held, refused, failed, timeout, invalid; joined: a request that waited for another's pull).",
                                ["model_name", "outcome"], registry=r)
        self.kv_pull_seconds = Histogram("kvfleet:kv_pull_seconds", "Time a request spent pulling its prefix "
                                         "from a peer before it was queued.", lab, buckets=QUEUE_BUCKETS, registry=r)
        self.kv_refusals = Counter("kvfleet:kv_import_refusals", "KV transfers refused, by reason (hash, tokens, "
                                   "layout, size, adapter, stream).", ["model_name", "reason"], registry=r)
        for direction in ("export", "import"):
            self.kv_blocks.labels(model_name, direction)
            self.kv_bytes.labels(model_name, direction)
        for outcome in PullOutcome:
            self.kv_pulls.labels(model_name, outcome.value)
        for reason in Refusal:
            self.kv_refusals.labels(model_name, reason.value)
        r.register(_StatsCollector(model_name, stats, extra_info))
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, ...

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self, arrival: float | None = None) -> RequestTimer:
        return RequestTimer(self, arrival)


class RequestTimer:
    """Observes one request's latencies as its outputs arrive; `finish` exactly once."""

    def __init__(self, metrics: EngineMetrics, arrival: float | None = None):
        self.m = metrics
        self.arrival = time.monotonic() if arrival is None else arrival
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.queue_observed = False
        self.done = False

    def on_output(self, num_new_steps: int, output=None) -> None:
        """num_new_steps: tokens per completion since the last output (several when outputs coalesce)."""
        now = time.monotonic()
        if not self.queue_observed and output is not None:
            rm = getattr(output, "metrics", None)
            sched = getattr(rm, "first_scheduled_time", None)
            arrived = getattr(rm, "arrival_time", None)
            if sched is not None and arrived is not None:
                self.m.queue.observe(max(0.0, sched - arrived))
                self.queue_observed = True
        if num_new_steps <= 0:
            return
        gaps = num_new_steps
        if self.first_token is None:
            self.first_token = now
            self.m.ttft.observe(now - self.arrival)
            sched = getattr(getattr(output, "metrics", None), "first_scheduled_time", None)
            computed = getattr(output, "num_prompt_tokens", 0) - getattr(output, "num_cached_tokens", 0)
            if sched is not None and computed > 0:
                self.m.prefill_seconds.inc(max(0.0, now - sched))
                self.m.prefill_tokens.inc(computed)
            gaps -= 1
            per = 0.0  # tokens that arrived together with the first one
        else:
            per = (now - self.last_token) / gaps
        for _ in range(gaps):
            self.m.itl.observe(per)
        self.last_token = now

    def finish(self, reason: str | None) -> None:
        if self.done:
            return
        self.done = True
        reason = reason if reason in ("stop", "length") else "abort"
        self.m.success[reason].inc()
        if reason == "abort":
            self.m.aborted.inc()
        else:
            self.m.e2e.observe(time.monotonic() - self.arrival)

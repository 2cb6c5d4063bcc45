"""Every metric DESIGN.md names is exported with a model_name label, and each moves when it should."""

from __future__ import annotations

import asyncio
import time

import httpx

DESIGN_METRICS = [
    "vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
    "vllm:cache_config_info",
    "kvfleet:block_allocation_failures_total", "kvfleet:block_evictions_total",
    "kvfleet:aborted_requests_total", "kvfleet:kv_events_published_total", "kvfleet:oom_events_total",
]
PROCESS_METRICS = ["process_resident_memory_bytes", "process_virtual_memory_bytes", "process_cpu_seconds_total",
                   "process_open_fds", "process_start_time_seconds"]
PROMPT = [{"role": "system", "content": "You are a careful assistant for harbour pilots. " * 6},
          {"role": "user", "content": "Which tide is best for entering the port?"}]


def chat(server, messages, max_tokens=6, **extra) -> dict:
    body = {"model": "smollm2", "messages": messages, "max_tokens": max_tokens, "logit_bias": {"2": -100}, **extra}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_every_design_metric_is_exported_with_model_name(api_server):
    samples = api_server.metrics()
    for name in DESIGN_METRICS:
        keys = [k for k in samples if k.split("{")[0] == name]
        assert keys, f"{name} missing from /metrics"
        assert all('model_name="smollm2"' in k for k in keys), keys
    info = next(k for k in samples if k.startswith("vllm:cache_config_info"))
    assert 'block_size="16"' in info and 'num_gpu_blocks="1024"' in info
    reasons = {k for k in samples if k.startswith("vllm:request_success_total")}
    assert {f'finished_reason="{r}"' in " ".join(reasons) for r in ("stop", "length", "abort")} == {True}


def test_process_metrics_and_gpu_memory_only_on_cuda(api_server):
    import torch

    samples = api_server.metrics()
    for name in PROCESS_METRICS:
        assert name in samples, f"{name} missing from /metrics"
    assert samples["process_resident_memory_bytes"] > 100 * 2**20  # the model's weights are in there
    assert api_server.metric("kvfleet:oom_events_total") == 0
    gpu = [k for k in samples if k.startswith("kvfleet:gpu_memory_used_bytes")]
    if torch.cuda.is_available():  # the engine chose the GPU
        assert gpu and samples[gpu[0]] > 0
    else:
        assert gpu == []


def test_counters_and_histograms_move(api_server):
    m = api_server.metric
    before = {n: m(n) for n in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                                "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                                "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                                "vllm:inter_token_latency_seconds_count", "vllm:request_queue_time_seconds_count",
                                "kvfleet:kv_events_published_total")}
    length_before = m("vllm:request_success_total", finished_reason="length")
    salt = f"metrics-{time.time_ns()}"  # a prefix no earlier test cached
    first = chat(api_server, PROMPT, cache_salt=salt)
    hits_mid = m("vllm:prefix_cache_hits_total")
    second = chat(api_server, PROMPT, cache_salt=salt)
    after = {n: m(n) for n in before}
    usage1, usage2 = first["usage"], second["usage"]
    assert usage1["prompt_tokens_details"]["cached_tokens"] == 0
    cached = usage2["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    assert hits_mid == before["vllm:prefix_cache_hits_total"]
    assert after["vllm:prefix_cache_hits_total"] - hits_mid == cached  # the repeat hit exactly what it reused
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == \
        usage1["prompt_tokens"] + usage2["prompt_tokens"]
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 12
    for n in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
              "vllm:request_queue_time_seconds_count"):
        assert after[n] - before[n] == 2, n
    assert after["vllm:inter_token_latency_seconds_count"] - before["vllm:inter_token_latency_seconds_count"] == 10
    assert m("vllm:request_success_total", finished_reason="length") - length_before == 2
    assert after["kvfleet:kv_events_published_total"] > before["kvfleet:kv_events_published_total"]


def test_waiting_and_running_with_more_requests_than_max_num_seqs(api_server):
    """API_FLAGS caps running sequences at 4: 10 concurrent requests must queue."""
    seen_waiting, seen_running = [], []

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(i):
                body = {"model": "smollm2", "max_tokens": 24, "ignore_eos": True,
                        "messages": [{"role": "user", "content": f"Count slowly to {i + 20}."}]}
                r = await client.post(f"{api_server.url}/v1/chat/completions", json=body)
                assert r.status_code == 200

            tasks = [asyncio.ensure_future(one(i)) for i in range(10)]
            while not all(t.done() for t in tasks):
                text = (await client.get(f"{api_server.url}/metrics")).text
                for line in text.splitlines():
                    if line.startswith("vllm:num_requests_waiting{"):
                        seen_waiting.append(float(line.rsplit(" ", 1)[1]))
                    if line.startswith("vllm:num_requests_running{"):
                        seen_running.append(float(line.rsplit(" ", 1)[1]))
                await asyncio.sleep(0.05)
            await asyncio.gather(*tasks)

    asyncio.run(run())
    assert max(seen_waiting) > 0
    assert 0 < max(seen_running) <= 4
    assert api_server.metric("vllm:num_requests_running") == 0
    assert api_server.metric("vllm:num_requests_waiting") == 0


def test_rejected_requests_counted_by_status(api_server):
    before = api_server.metric("kvfleet:rejected_requests_total", status="400")
    r = httpx.post(f"{api_server.url}/v1/chat/completions", json={"model": "smollm2", "messages": []}, timeout=30)
    assert r.status_code == 400
    assert api_server.metric("kvfleet:rejected_requests_total", status="400") - before == 1


def test_free_and_cached_blocks_at_idle_account_for_the_whole_pool(api_server):
    """What the chaos campaign's leak check reads: at idle every block is free (KV usage 0), and the prefix
    cache holds the blocks of what was just served (free, evictable), as many as its KV events announce."""
    chat(api_server, PROMPT)
    deadline = time.monotonic() + 10
    while True:
        m = api_server.metrics()
        total = api_server.metric("kvfleet:num_kv_blocks")
        free, cached = api_server.metric("kvfleet:num_free_kv_blocks"), api_server.metric("kvfleet:num_cached_kv_blocks")
        if free == total or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert total == 1024 and free == total and api_server.metric("vllm:kv_cache_usage_perc") == 0.0, m
    assert 0 < cached <= total  # the system prompt's blocks at least

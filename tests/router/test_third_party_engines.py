"""The router in front of engines it did not write: no /ready (vLLM, SGLang: readiness from /health), no
KV event stream (the approximate index), SGLang's metric names, every engine's model ids on /v1/models.
Against fake engines of each flavour (loadtest/fake_engine.py --flavor); tests/router/test_vllm_engines.py
(slow) runs real vLLM engines."""

from __future__ import annotations

import httpx

from router.routing.replicas import EngineLoad, parse_engine_metrics
from tests.router.conftest import fake_engine, free_port, metric, router, wait_for

PROMPT = list(range(200, 264))  # 64 token ids: 3 cacheable blocks of 16


def test_sglang_metric_names_are_load():
    text = ('# HELP sglang:num_running_reqs x\nsglang:num_running_reqs{model_name="m"} 3.0\n'
            'sglang:num_queue_reqs{model_name="m"} 7.0\nsglang:token_usage{model_name="m"} 0.25\n'
            'sglang:max_total_num_tokens{model_name="m"} 4096.0\nsglang:cache_hit_rate{model_name="m"} 0.5\n')
    assert parse_engine_metrics(text) == EngineLoad(kv_usage=0.25, running=3, waiting=7,
                                                    kv_capacity_tokens=4096.0, engine="sglang")
    assert parse_engine_metrics('vllm:num_requests_running{a="b"} 1\n').engine == "vllm"
    kvfleet = 'vllm:num_requests_running{a="b"} 1\nkvfleet:block_evictions_total{a="b"} 0\n'
    assert parse_engine_metrics(kvfleet).engine == "kvfleet"
    assert parse_engine_metrics("").engine == "unknown"


def test_vllm_and_sglang_flavoured_engines_behind_the_router(procs):
    v = fake_engine(procs, "v", "--flavor", "vllm", "--model", "llama-a").wait_ready(path="/health")
    s = fake_engine(procs, "s", "--flavor", "sglang", "--model", "llama-b").wait_ready(path="/health")
    assert httpx.get(v.url + "/ready").status_code == 404
    r = router(procs, [v.url, s.url], "--log-level", "info", policy="kv").wait_ready()
    wait_for(lambda: httpx.get(r.url + "/ready").json()["ready_replicas"] == 2, what="both ready via /health")
    log = r.tail()
    for url in (v.url, s.url):
        assert f"replica {url} has no /ready: its readiness is /health" in log
    wait_for(lambda: f"replica {v.url} is a vllm engine" in r.tail() and f"replica {s.url} is a sglang engine"
             in r.tail(), what="engine types logged")
    ids = [m["id"] for m in httpx.get(r.url + "/v1/models").json()["data"]]
    assert sorted(ids) == ["llama-a", "llama-b"]
    # each model goes to the replica that lists it; no KV event stream: the approximate index predicts the
    # repeated prompt's blocks there, and never on the other model's replica (which saw the same prompt)
    for model, replica in (("llama-a", v.url), ("llama-b", s.url)):
        for _ in range(4):
            resp = httpx.post(r.url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 2})
            assert resp.status_code == 200 and resp.headers["x-kvfleet-replica"] == replica
    text = httpx.get(r.url + "/metrics").text
    assert metric(text, "kvfleet_router_kv_events_live") == 0
    for replica in (v.url, s.url):  # 3 follow-ups x 3 blocks each
        assert metric(text, "kvfleet_router_predicted_cached_tokens_total", replica=replica) == 3 * 48
    resp = httpx.post(r.url + "/v1/completions", json={"model": "llama-c", "prompt": PROMPT, "max_tokens": 2})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


def test_declared_engine_type_skips_the_probes(procs):
    v = fake_engine(procs, "v", "--flavor", "vllm").wait_ready(path="/health")
    r = router(procs, [v.url], "--engine-type", "vllm", "--log-level", "info").wait_ready()
    wait_for(lambda: httpx.get(r.url + "/ready").json()["ready_replicas"] == 1, what="ready")
    assert "has no /ready" not in r.tail()  # it asked /health from the start
    assert httpx.post(r.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_a_kv_event_stream_that_never_goes_live_is_named_in_a_warning(procs):
    v = fake_engine(procs, "v", "--flavor", "vllm").wait_ready(path="/health")
    nobody = f"tcp://127.0.0.1:{free_port()}"  # a port no publisher binds: the subscriber waits silently
    r = router(procs, [v.url], "--engine-type", "vllm", "--vllm-kv-events", nobody, "--kv-heartbeat-timeout", "1",
               "--log-level", "info").wait_ready()
    wait_for(lambda: "its KV event stream is not live" in r.tail(), timeout=15, what="the warning")
    assert f"ZMQ {nobody}: is the engine publishing there?" in r.tail()
    assert httpx.post(r.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200

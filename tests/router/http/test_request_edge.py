"""The router's request edge against real processes (a router in front of fake engines): bodies no engine
could serve are the client's 400, never the pool's failure; /v1/models is never 200 before a chat can
succeed; having no ready replica yet does not degrade a pool."""

from __future__ import annotations

import time

import httpx

from tests.router.conftest import fake_engine, free_port, metric, router, wait_for

CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
POOLS = """
pools:
  default:
    version: v1
    weight: 1
    model: smollm2
    replicas: [{replica}]
degradation:
  window_s: 5
  min_requests: 3
  interval_s: 0.2
  dwell_s: 0.5
  error_rate: {{trip: 0.05, clear: 0.01}}
"""


def test_models_is_never_200_before_a_chat_can_succeed(procs):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    r = router(procs, [url], model="smollm2").wait_ready(path="/health")
    engine = None
    started = time.monotonic()
    seen = []
    while time.monotonic() - started < 30:
        if engine is None and time.monotonic() - started > 1.0:
            engine = fake_engine(procs, "late", port=port)  # the replica comes up after the router
        m = httpx.get(r.url + "/v1/models", timeout=5)
        c = httpx.post(r.url + "/v1/chat/completions", json=CHAT, timeout=10)
        seen.append((m.status_code, c.status_code))
        if m.status_code == 200:
            assert c.status_code == 200, f"/v1/models said 200, then a chat got {c.status_code}: {c.text}"
            assert [d["id"] for d in m.json()["data"]] == ["smollm2"]
            break
        assert m.status_code == 503 and m.headers["retry-after"] == "1"
        assert m.json()["error"]["code"] == "no_ready_replica"
        time.sleep(0.05)
    assert seen[0][0] == 503 and seen[-1] == (200, 200)


def test_no_ready_replica_is_not_the_pools_failure(procs, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    path = tmp_path / "pools.yaml"
    path.write_text(POOLS.format(replica=url))
    r = router(procs, None, "--pools", str(path)).wait_ready(path="/health")
    for _ in range(8):
        resp = httpx.post(r.url + "/v1/chat/completions", json=CHAT, timeout=5)
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["code"] == "no_replica_available"
    time.sleep(1.0)  # several degradation intervals
    text = httpx.get(r.url + "/metrics").text
    assert metric(text, "kvfleet_router_pool_no_ready_replica_total", pool="default") == 8
    assert metric(text, "kvfleet_router_pool_degradation_level", pool="default") == 0
    assert metric(text, "kvfleet_router_pool_requests_total", pool="default") == 0
    fake_engine(procs, "e1", port=port).wait_ready()
    wait_for(lambda: httpx.get(r.url + "/ready").status_code == 200, what="router ready")
    assert httpx.post(r.url + "/v1/chat/completions", json=CHAT, timeout=5).status_code == 200


def test_bad_bodies_are_the_clients_400_and_never_move_a_pools_health(procs, tmp_path):
    e = fake_engine(procs, "e1").wait_ready()
    path = tmp_path / "pools.yaml"
    path.write_text(POOLS.format(replica=e.url))
    r = router(procs, None, "--pools", str(path)).wait_ready()
    surrogate = b'{"model": "smollm2", "messages": [{"role": "user", "content": "\\ud800x"}]}'
    deep = b"[" * 50_000 + b"]" * 50_000
    for body, param in ((surrogate, "messages[0].content"), (deep, None),
                        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}', "max_tokens")):
        for _ in range(5):
            resp = httpx.post(r.url + "/v1/chat/completions", content=body,
                              headers={"content-type": "application/json"}, timeout=10)
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == param
    time.sleep(1.0)
    text = httpx.get(r.url + "/metrics").text
    assert metric(text, "kvfleet_router_pool_degradation_level", pool="default") == 0
    assert httpx.get(e.url + "/fake/stats").json()["requests"] == 0  # none reached the engine
    big = {**CHAT, "max_tokens": 4000}
    assert httpx.post(r.url + "/v1/chat/completions", json=big, timeout=10).status_code == 200


def test_ready_is_never_200_before_the_replicas_models_are_known(procs):
    # a router that learns its models from the replicas (no --model); the replica answers /v1/models slowly:
    # its readiness and its models change together, so a 200 from /ready is never followed by a 404 for the model
    e = fake_engine(procs, "slow-models", "--models-delay-ms", "1500").wait_ready()
    r = router(procs, [e.url], model="").wait_ready(path="/health")
    started = time.monotonic()
    while time.monotonic() - started < 30:
        if httpx.get(r.url + "/ready", timeout=5).status_code == 200:
            c = httpx.post(r.url + "/v1/chat/completions", json=CHAT, timeout=10)
            assert c.status_code == 200, f"/ready said 200, then a chat got {c.status_code}: {c.text}"
            assert [d["id"] for d in httpx.get(r.url + "/v1/models", timeout=5).json()["data"]] == ["smollm2"]
            return
        time.sleep(0.02)
    raise AssertionError("the router never became ready")

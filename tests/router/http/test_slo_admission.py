"""Latency targets through a real router over fake engines: once the router's TTFT model has 16 first tokens (each
60 ms after a request), a request whose `x-llm-d-slo-ttft-ms` no replica is predicted to meet gets 429
`slo_unattainable` with Retry-After before anything is sent to an engine; likewise for `x-llm-d-slo-tpot-ms` once
the TPOT model has 16 finished streams (tokens 30 ms apart); one that can be met is served; a bad target is a 400
naming the header."""

from __future__ import annotations

import httpx

from tests.router.conftest import fake_engine, metric, ready_replicas, router, wait_for


def _chat(stream: bool = False) -> dict:
    return {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}


def test_a_ttft_target_no_replica_can_meet_is_refused_and_one_it_can_is_served(procs):
    engines = [fake_engine(procs, f"e{i}", "--delay-ms", "60") for i in range(2)]
    for e in engines:
        e.wait_ready()
    r = router(procs, [e.url for e in engines], policy="least-load").wait_ready()
    wait_for(lambda: ready_replicas(r) == 2, what="both replicas ready")
    with httpx.Client(base_url=r.url, timeout=30) as c:
        bad = c.post("/v1/chat/completions", json=_chat(), headers={"x-llm-d-slo-ttft-ms": "soon"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-llm-d-slo-ttft-ms"
        # before the model has its 16 first tokens nothing is predicted, so nothing is refused
        early = c.post("/v1/chat/completions", json=_chat(), headers={"x-llm-d-slo-ttft-ms": "1"})
        assert early.status_code == 200, early.text
        for _ in range(16):
            with c.stream("POST", "/v1/chat/completions", json=_chat(stream=True)) as s:
                assert s.status_code == 200
                s.read()
        served_before = sum(httpx.get(e.url + "/fake/stats").json()["requests"] for e in engines)
        late = c.post("/v1/chat/completions", json=_chat(), headers={"x-llm-d-slo-ttft-ms": "1"})
        assert late.status_code == 429, late.text
        err = late.json()["error"]
        assert err["code"] == "slo_unattainable" and err["param"] == "x-llm-d-slo-ttft-ms"
        assert "predicted" in err["message"] and int(late.headers["retry-after"]) >= 1
        served_after = sum(httpx.get(e.url + "/fake/stats").json()["requests"] for e in engines)
        assert served_after == served_before  # refused before any engine saw it
        with c.stream("POST", "/v1/chat/completions", json=_chat(stream=True),
                      headers={"x-llm-d-slo-ttft-ms": "5000"}) as ok:
            assert ok.status_code == 200
            ok.read()
        # the stream is counted after its last byte, when the router settles it: wait for that, not for the client
        wait_for(lambda: metric(c.get("/metrics").text, "kvfleet_router_slo_ttft_requests_total",
                                outcome="met", priority="-") >= 1, what="the 5,000 ms request counted as met")
        text = c.get("/metrics").text
    assert metric(text, "kvfleet_router_slo_refused_requests_total") == 1
    assert metric(text, "kvfleet_router_slo_ttft_requests_total", outcome="met", priority="-") == 1  # the 5,000 ms one
    assert metric(text, "kvfleet_router_ttft_predicted_requests_total") >= 1
    assert metric(text, "kvfleet_router_ttft_prediction_error_seconds_count") >= 1
    assert metric(text, "kvfleet_router_ttft_prediction_relative_error_count") >= 1


def test_a_tpot_target_no_replica_can_meet_is_refused_and_one_it_can_is_served(procs):
    # fake engines streaming 8 chunks 30 ms apart: once the TPOT model has 16 finished streams, every replica is
    # predicted at ~30 ms per token
    engines = [fake_engine(procs, f"e{i}") for i in range(2)]
    for e in engines:
        e.wait_ready()
    r = router(procs, [e.url for e in engines], policy="least-load").wait_ready()
    wait_for(lambda: ready_replicas(r) == 2, what="both replicas ready")
    slow = {"x-fake-chunk-delay-ms": "30"}
    with httpx.Client(base_url=r.url, timeout=30) as c:
        bad = c.post("/v1/chat/completions", json=_chat(), headers={"x-llm-d-slo-tpot-ms": "-3"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-llm-d-slo-tpot-ms"
        for _ in range(20):  # a client that asked for no usage gets none, though the router asked the engine
            with c.stream("POST", "/v1/chat/completions", json={**_chat(stream=True), "max_tokens": 8},
                          headers=slow) as s:
                assert s.status_code == 200
                assert '"usage"' not in s.read().decode()
        # a stream is learned from once it has settled, after its last byte: the last ones came with predictions
        wait_for(lambda: metric(c.get("/metrics").text, "kvfleet_router_tpot_predicted_requests_total") >= 1,
                 what="the TPOT model fitted")
        served_before = sum(httpx.get(e.url + "/fake/stats").json()["requests"] for e in engines)
        late = c.post("/v1/chat/completions", json=_chat(stream=True), headers={**slow, "x-llm-d-slo-tpot-ms": "5"})
        assert late.status_code == 429, late.text
        err = late.json()["error"]
        assert err["code"] == "slo_unattainable" and err["param"] == "x-llm-d-slo-tpot-ms"
        assert "each later token" in err["message"] and late.headers["retry-after"] == "1"
        assert sum(httpx.get(e.url + "/fake/stats").json()["requests"] for e in engines) == served_before
        with c.stream("POST", "/v1/chat/completions", json={**_chat(stream=True), "max_tokens": 8},
                      headers={**slow, "x-llm-d-slo-tpot-ms": "500"}) as ok:
            assert ok.status_code == 200
            ok.read()
        wait_for(lambda: metric(c.get("/metrics").text, "kvfleet_router_slo_tpot_requests_total",
                                outcome="met", priority="-") >= 1, what="the 500 ms request counted as met")
        text = c.get("/metrics").text
    assert metric(text, "kvfleet_router_slo_refused_requests_total") == 1
    assert metric(text, "kvfleet_router_slo_tpot_requests_total", outcome="met", priority="-") == 1
    assert metric(text, "kvfleet_router_tpot_predicted_requests_total") >= 1
    assert metric(text, "kvfleet_router_tpot_prediction_error_seconds_count") >= 1
    # ~30 ms per token observed and predicted alike: the model is within half of it
    assert metric(text, "kvfleet_router_tpot_prediction_relative_error_bucket", le="0.5") >= 1


def test_a_best_effort_pool_serves_an_unattainable_target_instead_of_refusing_it(procs, tmp_path):
    engines = [fake_engine(procs, f"e{i}", "--delay-ms", "60") for i in range(2)]
    for e in engines:
        e.wait_ready()
    pools = tmp_path / "pools.yaml"
    pools.write_text("pools:\n  default:\n    version: v1\n    weight: 1\n    model: smollm2\n"
                     "    slo_ttft_ms: 1\n    slo_unattainable: best_effort\n"
                     f"    replicas: [{', '.join(e.url for e in engines)}]\n")
    r = router(procs, None, "--pools", str(pools), policy="least-load").wait_ready()
    wait_for(lambda: ready_replicas(r) == 2, what="both replicas ready")
    with httpx.Client(base_url=r.url, timeout=30) as c:
        for _ in range(17):  # the TTFT model fits on 16 first tokens; every request carries the pool's 1 ms target
            with c.stream("POST", "/v1/chat/completions", json=_chat(stream=True)) as s:
                assert s.status_code == 200
                s.read()
        wait_for(lambda: metric(c.get("/metrics").text, "kvfleet_router_ttft_predicted_requests_total") >= 1,
                 what="the TTFT model fitted")
        served = [c.post("/v1/chat/completions", json=_chat()).status_code for _ in range(3)]
        text = c.get("/metrics").text
    assert served == [200, 200, 200]  # predicted ~60 ms against 1 ms: served anyway, not 429
    assert metric(text, "kvfleet_router_slo_refused_requests_total") == 0
    assert metric(text, "kvfleet_router_slo_best_effort_requests_total", pool="default") >= 3

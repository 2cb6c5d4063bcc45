"""Latency targets through the endpoint picker (the test gateway over gRPC, fake engines 60 ms to a first byte):
the picker learns TTFT and TPOT from the streams that pass back through it as the router does; once fitted, a
request whose `x-llm-d-slo-ttft-ms` no endpoint is predicted to meet gets an ImmediateResponse 429
`slo_unattainable` with Retry-After before any endpoint is named, one it can meet is placed and counted met, and
the pool's desired replicas follow (kvfleet_router_pool_desired_replicas)."""

from __future__ import annotations

import httpx

from tests.router.conftest import fake_engine, metric, wait_for
from tests.router.epp.gateway import Gateway
from tests.router.epp.test_picker_fake import _completion, picker


def test_the_picker_refuses_a_target_no_endpoint_can_meet_and_places_one_it_can(procs):
    engines = [fake_engine(procs, f"e{i}", "--delay-ms", "60") for i in range(2)]
    for e in engines:
        e.wait_ready()
    p, address = picker(procs, [e.url for e in engines])
    gw = Gateway(address)
    bad = gw.send("/v1/completions", _completion(), headers={"x-llm-d-slo-ttft-ms": "soon"})
    assert bad.status == 400 and bad.json()["error"]["param"] == "x-llm-d-slo-ttft-ms"
    for _ in range(18):  # streams: the first token and the end of each pass back through the picker
        got = gw.send("/v1/completions", _completion(stream=True, max_tokens=8),
                      headers={"x-llm-d-slo-ttft-ms": "5000", "x-llm-d-slo-tpot-ms": "5000"})
        assert got.status == 200, got.body
    wait_for(lambda: metric(httpx.get(p.url + "/metrics").text, "kvfleet_router_ttft_predicted_requests_total") >= 1,
             what="the TTFT model fitted from the streams")
    late = gw.send("/v1/completions", _completion(stream=True), headers={"x-llm-d-slo-ttft-ms": "1"})
    assert late.status == 429, late.body
    err = late.json()["error"]
    assert err["code"] == "slo_unattainable" and err["param"] == "x-llm-d-slo-ttft-ms"
    assert int(late.headers["retry-after"]) >= 1 and late.endpoints == []  # refused before any endpoint was named
    ok = gw.send("/v1/completions", _completion(stream=True), headers={"x-llm-d-slo-ttft-ms": "5000"})
    assert ok.status == 200 and ok.served
    text = httpx.get(p.url + "/metrics").text
    assert metric(text, "kvfleet_router_slo_refused_requests_total") == 1
    assert metric(text, "kvfleet_router_slo_ttft_requests_total", outcome="met") >= 19
    assert metric(text, "kvfleet_router_tpot_predicted_requests_total") >= 1  # the TPOT model learned too
    assert metric(text, "kvfleet_router_pool_desired_replicas", pool="default") == 1  # 60 ms against 5 s: one

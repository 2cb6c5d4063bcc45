"""The router as a real process in front of fake engine processes on loopback: passthrough, streaming,
retries before the first byte, mid-stream failure, client disconnect, errors, KV-event routing and resync."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

from tests.router.conftest import fake_engine, metric, router, wait_for

CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def pair(procs):
    a, b = fake_engine(procs, "a"), fake_engine(procs, "b")
    r = router(procs, [a.url, b.url], policy="round-robin")
    for p in (a, b, r):
        p.wait_ready()
    return a, b, r


def test_passthrough_streaming_errors_and_endpoints(pair):
    a, b, r = pair
    with httpx.Client(base_url=r.url, timeout=10) as c:
        served = []
        for _ in range(4):
            resp = c.post("/v1/chat/completions", json=CHAT)
            assert resp.status_code == 200
            body = resp.json()
            assert body["choices"][0]["message"]["content"] == " tok" * 4
            assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
            assert resp.headers["x-fake-instance"] in ("a", "b")
            served.append(resp.headers["x-kvfleet-replica"])
        assert sorted(served) == sorted([a.url, b.url] * 2)  # round-robin over both
        # streaming: every chunk, in order, ending with [DONE]
        with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            lines = [ln for ln in resp.iter_lines() if ln]
        assert lines[-1] == "data: [DONE]" and len(lines) == 5
        assert [json.loads(ln[6:])["choices"][0]["delta"]["content"] for ln in lines[:-1]] == [" tok"] * 4
        # an engine's 4xx passes through untouched and is not retried
        resp = c.post("/v1/completions", json={"prompt": "x"}, headers={"x-fake-status": "400"})
        assert resp.status_code == 400 and resp.json()["error"]["message"] == "fake failure 400"
        # router-level errors are OpenAI-shaped
        resp = c.post("/v1/chat/completions", content=b"{not json")
        assert resp.status_code == 400 and "not valid JSON" in resp.json()["error"]["message"]
        resp = c.post("/v1/chat/completions", content=b"[1]")
        assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
        assert c.get("/v1/chat/completions").status_code == 405
        resp = c.get("/v1/nothing")
        assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"
        assert resp.json()["error"]["code"] is None  # a string or null, never the status
        assert c.get("/v1/models").json()["data"][0]["id"] == "smollm2"
        assert c.get("/health").json() == {"status": "ok"}
        assert c.get("/ready").json()["ready_replicas"] == 2
        m = c.get("/metrics").text
    assert metric(m, "kvfleet_router_requests_total", policy="round-robin", status="200") == 5
    assert metric(m, "kvfleet_router_requests_total", status="400") == 1
    assert metric(m, "kvfleet_router_replicas", state="ready") == 2
    assert metric(m, "kvfleet_router_circuit_state", replica=a.url, state="closed") == 1
    assert metric(m, "kvfleet_router_routing_decision_seconds_count") == 6


def test_openai_client_through_the_router(pair):
    _, _, r = pair
    client = openai.OpenAI(base_url=r.url + "/v1", api_key="unused", max_retries=0, timeout=10)
    out = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert out.choices[0].message.content == " tok" * 4
    stream = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == " tok" * 4
    assert chunks[-1].usage.prompt_tokens == 8
    comp = client.completions.create(model="smollm2", prompt=[1, 2, 3], max_tokens=4)
    assert comp.choices[0].text == " tok" * 4


def test_retry_before_first_byte_and_circuit_breaker(procs):
    bad = fake_engine(procs, "bad", "--fail-status", "502")
    good = fake_engine(procs, "good")
    r = router(procs, [bad.url, good.url], "--breaker-open", "30", policy="round-robin")
    for p in (bad, good, r):
        p.wait_ready()
    with httpx.Client(base_url=r.url, timeout=10) as c:
        for _ in range(8):
            resp = c.post("/v1/chat/completions", json=CHAT)
            assert resp.status_code == 200 and resp.headers["x-kvfleet-replica"] == good.url
        m = c.get("/metrics").text
        stats = httpx.get(bad.url + "/fake/stats").json()
    # three failures open the circuit; after that the bad replica gets no more attempts
    assert stats["requests"] == 3
    assert metric(m, "kvfleet_router_retries_total") == 3
    assert metric(m, "kvfleet_router_circuit_state", replica=bad.url, state="open") == 1
    assert metric(m, "kvfleet_router_upstream_failures_total") == 0  # HTTP 502 is not a transport failure


def test_all_replicas_failing_gives_a_clear_503(procs):
    bad = fake_engine(procs, "bad", "--fail-status", "503")
    r = router(procs, [bad.url], "--max-attempts", "2", policy="least-load")
    bad.wait_ready()
    r.wait_ready()
    resp = httpx.post(r.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert resp.status_code == 503
    err = resp.json()["error"]
    assert err["type"] == "service_unavailable" and "HTTP 503" in err["message"] and bad.url in err["message"]
    # when discovery knows no ready replica at all, the router says so immediately
    httpx.post(bad.url + "/fake/ready?0")
    wait_for(lambda: httpx.get(r.url + "/ready").status_code == 503, what="router not ready")
    resp = httpx.post(r.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert resp.status_code == 503 and "no ready replica" in resp.json()["error"]["message"]


def test_queue_full_429_is_retried_elsewhere_and_handed_on_when_every_replica_refuses(procs):
    full, good = fake_engine(procs, "full", "--fail-status", "429"), fake_engine(procs, "good")
    r = router(procs, [full.url, good.url], "--breaker-failures", "2", policy="round-robin")
    for p in (full, good, r):
        p.wait_ready()
    with httpx.Client(base_url=r.url, timeout=10) as c:
        for _ in range(6):
            resp = c.post("/v1/chat/completions", json=CHAT)
            assert resp.status_code == 200 and resp.headers["x-kvfleet-replica"] == good.url
        m = c.get("/metrics").text
    refused = httpx.get(full.url + "/fake/stats").json()["requests"]
    # round-robin offers `full` first on at least 5 of the 6 requests; a 429 is not a failure, so its circuit
    # stays closed (two failures would have opened it after 2)
    assert refused >= 5
    assert metric(m, "kvfleet_router_retries_total", reason="queue-full") == refused
    assert metric(m, "kvfleet_router_circuit_state", replica=full.url, state="closed") == 1
    # every replica refuses: the client gets the engine's 429, Retry-After included, not a 502/503
    full2 = fake_engine(procs, "full2", "--fail-status", "429")
    r2 = router(procs, [full.url, full2.url], policy="least-load")
    full2.wait_ready()
    r2.wait_ready()
    resp = httpx.post(r2.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
    assert resp.json()["error"] == {"message": "fake failure 429", "type": "rate_limit_error", "param": None, "code": None}
    assert httpx.get(full2.url + "/fake/stats").json()["requests"] == 1  # each replica tried once
    assert metric(httpx.get(r2.url + "/metrics").text, "kvfleet_router_requests_total", replica="none",
                  status="429") == 1


def test_access_log_has_one_line_per_request_and_scrapes_stay_quiet(procs):
    a = fake_engine(procs, "a")
    logged = router(procs, [a.url], "--log-level", "info", "--access-log", policy="least-load")
    quiet = router(procs, [a.url], "--log-level", "info", policy="least-load")
    for p in (a, logged, quiet):
        p.wait_ready()
    for r in (logged, quiet):
        assert httpx.post(r.url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 200
        httpx.get(r.url + "/metrics")
    time.sleep(1.0)  # five rounds of health checks and scrapes (every 0.2 s)
    lines = [ln for ln in logged.tail(100_000).splitlines() if "kvfleet.router.access" in ln]
    assert len(lines) == 1, lines
    assert re.search(rf"INFO kvfleet.router.access: POST /v1/chat/completions 200 replica={a.url} "
                     r"latency_ms=\d+\.\d cached_tokens=0 retries=0 migrations=0$", lines[0]), lines[0]
    for r in (logged, quiet):
        log = r.tail(100_000)
        assert f"INFO kvfleet.router.fleet: replica joined pool default: {a.url}" in log  # it does log at INFO
        assert "HTTP Request:" not in log and " httpx:" not in log  # no line per health check or scrape
    assert "kvfleet.router.access" not in quiet.tail(100_000)


def test_replica_dying_mid_stream_ends_with_an_error_event_when_streams_do_not_move(procs, pair):
    a, b, _ = pair
    r = router(procs, [a.url, b.url], "--max-migrations", "0", policy="round-robin").wait_ready()
    t0 = time.monotonic()
    with httpx.stream("POST", r.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=10,
                      headers={"x-fake-break-after": "3", "x-fake-chunk-delay-ms": "20"}) as resp:
        assert resp.status_code == 200
        lines = [ln for ln in resp.iter_lines() if ln]
    assert time.monotonic() - t0 < 5
    assert len(lines) == 5, lines  # 3 chunks, the error event, [DONE]
    err = json.loads(lines[3][6:])["error"]
    assert "failed mid-stream" in err["message"] and err["type"] == "upstream_error" and err["code"] == "upstream_failed"
    assert lines[4] == "data: [DONE]"
    # the openai client turns that event into an exception instead of hanging or truncating silently
    client = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0, timeout=10)
    with pytest.raises(openai.APIError):
        for _ in client.chat.completions.create(model="smollm2", messages=CHAT["messages"], stream=True,
                                                extra_headers={"x-fake-break-after": "2"}):
            pass


def test_client_disconnect_cancels_the_upstream_request(pair):
    a, b, r = pair
    with httpx.stream("POST", r.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=10,
                      headers={"x-fake-chunks": "200", "x-fake-chunk-delay-ms": "50"}) as resp:
        replica = resp.headers["x-kvfleet-replica"]
        it = resp.iter_lines()
        next(it)
    # the client hung up after one chunk; the engine stops generating within a chunk or two
    stats = wait_for(lambda: (s := httpx.get(replica + "/fake/stats").json())["cancelled"] == 1 and s, timeout=5,
                     what="upstream cancellation")
    assert stats["completed"] == 0 and stats["running"] == 0
    wait_for(lambda: metric(httpx.get(r.url + "/metrics").text, "kvfleet_router_requests_total",
                            status="cancelled") == 1, what="router counted the cancellation")
    assert metric(httpx.get(r.url + "/metrics").text, "kvfleet_router_inflight_requests") == 0


def test_kv_events_steer_follow_ups_and_resync_after_a_gap(procs):
    a, b = fake_engine(procs, "a", "--block-size", "4"), fake_engine(procs, "b", "--block-size", "4")
    r = router(procs, [a.url, b.url], policy="kv")
    for p in (a, b, r):
        p.wait_ready()
    live = lambda: metric(httpx.get(r.url + "/metrics").text, "kvfleet_router_kv_events_live") == 2  # noqa: E731
    wait_for(live, what="both KV event streams live")
    homes = {}
    with httpx.Client(base_url=r.url, timeout=10) as c:
        for conv in range(6):  # six conversations, each prompt 3 blocks
            prompt = [1000 * (conv + 1) + i for i in range(12)]
            resp = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
            homes[conv] = resp.headers["x-kvfleet-replica"]
        assert set(homes.values()) == {a.url, b.url}  # cold prompts spread by load
        indexed = lambda: metric(c.get("/metrics").text, "kvfleet_router_indexed_blocks") == 18  # noqa: E731
        wait_for(indexed, what="router index caught up")
        for turn in range(2):  # follow-ups extend the history: they go home, and hit
            for conv in range(6):
                prompt = [1000 * (conv + 1) + i for i in range(12 + 8 * (turn + 1))]
                resp = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
                assert resp.headers["x-kvfleet-replica"] == homes[conv], (conv, turn)
                assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 12 + 8 * turn
            wait_for(lambda t=turn: metric(c.get("/metrics").text, "kvfleet_router_indexed_blocks") == 18 + 12 * (t + 1),
                     what="index caught up")
        m = c.get("/metrics").text
        assert metric(m, "kvfleet_router_predicted_cached_tokens_total") == \
            metric(m, "kvfleet_router_reported_cached_tokens_total") == 6 * 12 + 6 * 20
        assert metric(m, "kvfleet_router_routing_decisions_total", reason="cache") == 12
        # a sequence gap on replica a: the router notices on the next event and takes a fresh snapshot
        httpx.post(a.url + "/fake/skip-seq")
        conv_on_a = next(k for k, v in homes.items() if v == a.url)
        c.post("/v1/completions", json={"prompt": [7] * 9, "max_tokens": 2, "user": "x"})
        wait_for(lambda: metric(c.get("/metrics").text, "kvfleet_router_kv_event_resyncs_total",
                                replica=a.url, reason="heartbeat-gap") +
                 metric(c.get("/metrics").text, "kvfleet_router_kv_event_resyncs_total", replica=a.url,
                        reason="gap") >= 1, what="resync")
        wait_for(live, what="live again")
        prompt = [1000 * (conv_on_a + 1) + i for i in range(40)]
        assert c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).headers["x-kvfleet-replica"] == a.url


def test_without_kv_events_the_approximate_index_takes_over(procs):
    a, b = (fake_engine(procs, n, "--block-size", "16", "--no-kv-events") for n in ("a", "b"))
    r = router(procs, [a.url, b.url], "--block-size", "16", policy="kv")
    for p in (a, b, r):
        p.wait_ready()
    homes = {}
    with httpx.Client(base_url=r.url, timeout=10) as c:
        for conv in range(4):
            resp = c.post("/v1/completions", json={"prompt": [conv + 1] * 40, "max_tokens": 2})
            homes[conv] = resp.headers["x-kvfleet-replica"]
        assert set(homes.values()) == {a.url, b.url}
        for conv in range(4):
            resp = c.post("/v1/completions", json={"prompt": [conv + 1] * 60, "max_tokens": 2})
            assert resp.headers["x-kvfleet-replica"] == homes[conv]
            assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        m = c.get("/metrics").text
    assert metric(m, "kvfleet_router_kv_events_live") == 0
    assert metric(m, "kvfleet_router_routing_decisions_total", reason="cache") == 4


def test_a_frozen_replica_is_resynced_and_avoided(procs):
    """SIGSTOP a replica: its KV event stream goes silent (heartbeat timeout → resync), its health checks
    fail, and traffic moves to the other one; after SIGCONT it is back in both respects."""
    import os
    import signal

    a, b = fake_engine(procs, "a"), fake_engine(procs, "b")
    r = router(procs, [a.url, b.url], "--kv-heartbeat-timeout", "1.0", policy="kv")
    for p in (a, b, r):
        p.wait_ready()
    m = lambda: httpx.get(r.url + "/metrics").text  # noqa: E731
    wait_for(lambda: metric(m(), "kvfleet_router_kv_events_live") == 2, what="live")
    os.killpg(a.popen.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: metric(m(), "kvfleet_router_kv_event_resyncs_total", replica=a.url,
                                reason="heartbeat-timeout") >= 1, timeout=10, what="heartbeat timeout")
        wait_for(lambda: metric(m(), "kvfleet_router_replica_ready", replica=a.url) == 0, timeout=10,
                 what="not ready")
        for _ in range(4):
            resp = httpx.post(r.url + "/v1/completions", json={"prompt": [1, 2, 3]}, timeout=10)
            assert resp.headers["x-kvfleet-replica"] == b.url
    finally:
        os.killpg(a.popen.pid, signal.SIGCONT)
    wait_for(lambda: metric(m(), "kvfleet_router_kv_events_live") == 2, timeout=10, what="live again")
    wait_for(lambda: metric(m(), "kvfleet_router_replica_ready", replica=a.url) == 1, timeout=10, what="ready")


def test_keep_alive_comments_pass_through_and_are_not_the_first_token(procs):
    e = fake_engine(procs, "e1", "--chunks", "3").wait_ready()
    r = router(procs, [e.url], policy="round-robin").wait_ready()
    headers = {"x-fake-keepalives": "3", "x-fake-keepalive-ms": "200"}
    with httpx.stream("POST", r.url + "/v1/completions", json={"prompt": [1, 2, 3], "stream": True},
                      headers=headers, timeout=10) as resp:
        lines = [ln for ln in resp.iter_lines() if ln]
    assert lines[:3] == [": keep-alive"] * 3 and lines[-1] == "data: [DONE]"
    assert len([ln for ln in lines if ln.startswith("data: {")]) == 3
    # the stream is observed after its last byte, when the router settles it
    wait_for(lambda: metric(httpx.get(r.url + "/metrics").text, "kvfleet_router_pool_ttft_seconds_count") == 1,
             what="the stream's TTFT observed")
    text = httpx.get(r.url + "/metrics").text
    # the router's TTFT counts from the first token, after the three comments (~0.6 s), not the first byte
    assert metric(text, "kvfleet_router_pool_ttft_seconds_bucket", le="0.5") == 0
    assert metric(text, "kvfleet_router_pool_ttft_seconds_count") == 1

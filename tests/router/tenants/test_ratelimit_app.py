"""Tenants and token budgets through a real router process in front of fake engines (loadtest/fake_engine.py,
which reports usage like vLLM and kvfleet, continuous_usage_stats included), budgets in the router's memory
or in a real Redis (deploy/redis_server.py)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from router.tenants.registry import key_sha256
from tests.router.conftest import fake_engine, metric, router, wait_for

KEY_A, KEY_B, KEY_C = "sk-alpha-Zq81mXr0", "sk-beta-Jw4Tt9vP", "sk-gamma-Lk2Pp7sQ"
TENANTS = f"""
tenants:
  alpha:
    api_key_sha256: ["{key_sha256(KEY_A)}"]
    tokens_per_minute: 600
    max_tokens: 40
    isolate_cache: true
  beta:
    api_key_sha256: ["{key_sha256(KEY_B)}"]
    tokens_per_minute: 100000
    max_concurrent_requests: 1
    max_context_tokens: 200
  gamma:
    api_key_sha256: ["{key_sha256(KEY_C)}"]
    tokens_per_minute: 100000
"""
PROMPT = list(range(100, 120))  # 20 token ids: no tokenizer needed


def auth(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture
def fleet(procs, tmp_path):
    engine = fake_engine(procs, "e1", "--chunks", "8").wait_ready()
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS)
    r = router(procs, [engine.url], "--tenants", str(path), policy="least-load").wait_ready()
    return r, engine, path


def stats(engine) -> dict:
    return httpx.get(engine.url + "/fake/stats").json()


def router_metric(r, name: str, **labels) -> float:
    return metric(httpx.get(r.url + "/metrics").text, name, **labels)


def test_missing_and_unknown_keys_get_401_and_never_reach_an_engine(fleet):
    r, engine, _ = fleet
    before = stats(engine)["requests"]
    body = {"prompt": PROMPT, "max_tokens": 8}
    for headers in ({}, auth("sk-not-a-key-0000"), {"api-key": "sk-also-wrong"}, {"authorization": "Basic abc"}):
        resp = httpx.post(r.url + "/v1/completions", json=body, headers=headers)
        assert resp.status_code == 401, resp.text
        assert resp.json()["error"]["code"] == "invalid_api_key"
        assert resp.headers["www-authenticate"] == "Bearer"
        assert "sk-not-a-key" not in resp.text and "sk-also-wrong" not in resp.text
    assert stats(engine)["requests"] == before
    assert router_metric(r, "kvfleet_router_ratelimit_requests_total", tenant="-", outcome="unauthorized") == 4
    ok = httpx.post(r.url + "/v1/completions", json=body, headers={"api-key": KEY_C})
    assert ok.status_code == 200 and stats(engine)["requests"] == before + 1
    text = httpx.get(r.url + "/metrics").text + r.tail(10**6)
    for key in (KEY_A, KEY_B, KEY_C, "sk-not-a-key-0000", "sk-also-wrong"):
        assert key not in text


def test_headers_settlement_and_refund(fleet):
    r, _, _ = fleet
    body = {"prompt": PROMPT, "max_tokens": 40}
    resp = httpx.post(r.url + "/v1/completions", json=body, headers=auth(KEY_A))
    assert resp.status_code == 200, resp.text
    # reserved 20 + 40 = 60 of 600; the engine used 20 + 8 = 28, so 32 come back at settlement
    assert resp.headers["x-ratelimit-limit-tokens"] == "600"
    assert resp.headers["x-ratelimit-remaining-tokens"] == "540"
    assert router_metric(r, "kvfleet_router_ratelimit_tokens_total", tenant="alpha", kind="reserved") == 60
    assert router_metric(r, "kvfleet_router_ratelimit_tokens_total", tenant="alpha", kind="used") == 28
    assert router_metric(r, "kvfleet_router_ratelimit_tokens_total", tenant="alpha", kind="refunded") == 32
    assert router_metric(r, "kvfleet_router_ratelimit_reserved_tokens", tenant="alpha") == 0
    resp = httpx.post(r.url + "/v1/completions", json=body, headers=auth(KEY_A))
    remaining = int(resp.headers["x-ratelimit-remaining-tokens"])
    assert 600 - 28 - 60 <= remaining <= 600 - 28 - 60 + 5  # plus what refilled meanwhile (10 tokens/s)


def test_max_tokens_cap_default_context_limit_and_too_large(fleet):
    r, engine, _ = fleet
    resp = httpx.post(r.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 41}, headers=auth(KEY_A))
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"
    assert "limit of 40" in resp.json()["error"]["message"]
    # no max_tokens: the tenant's cap is the default, and what is reserved
    before = router_metric(r, "kvfleet_router_ratelimit_tokens_total", tenant="alpha", kind="reserved")
    assert httpx.post(r.url + "/v1/completions", json={"prompt": PROMPT}, headers=auth(KEY_A)).status_code == 200
    assert router_metric(r, "kvfleet_router_ratelimit_tokens_total", tenant="alpha", kind="reserved") - before == 60
    # beta: prompt + max_tokens above max_context_tokens (200)
    resp = httpx.post(r.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 181}, headers=auth(KEY_B))
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"
    # alpha: 3 prompts x n=4 x 40 + 60 prompt tokens = 540 fits 600; n=5 (660) never fits: 400, not 429
    many = {"prompt": [PROMPT, PROMPT, PROMPT], "max_tokens": 40, "n": 5}
    resp = httpx.post(r.url + "/v1/completions", json=many, headers=auth(KEY_A))
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "request_too_large", resp.text
    assert "660" in resp.json()["error"]["message"]


def test_budget_exhausted_gets_429_with_retry_after(fleet):
    r, _, _ = fleet
    body = {"prompt": PROMPT, "max_tokens": 40, "n": 4}  # 20 + 160 = 180 reserved; the fake engine uses 20 + 40
    codes = [httpx.post(r.url + "/v1/completions", json=body, headers={**auth(KEY_A), "x-fake-chunks": "40"})
             for _ in range(12)]
    refused = [c for c in codes if c.status_code == 429]
    assert refused, [c.status_code for c in codes]
    err = refused[0]
    assert err.json()["error"]["code"] == "rate_limit_exceeded" and err.json()["error"]["type"] == "tokens"
    assert int(err.headers["retry-after"]) >= 1 and int(err.headers["x-ratelimit-remaining-tokens"]) < 180
    assert router_metric(r, "kvfleet_router_ratelimit_requests_total", tenant="alpha",
                         outcome="rejected_tokens") == len(refused)


def test_concurrency_limit(fleet):
    r, _, _ = fleet
    with httpx.Client(timeout=10) as c, c.stream(
            "POST", r.url + "/v1/completions", headers={**auth(KEY_B), "x-fake-chunk-delay-ms": "200"},
            json={"prompt": PROMPT, "max_tokens": 8, "stream": True}) as first:
        assert first.status_code == 200
        second = c.post(r.url + "/v1/completions", headers=auth(KEY_B), json={"prompt": PROMPT, "max_tokens": 8})
        assert second.status_code == 429 and second.json()["error"]["type"] == "requests"
        first.read()
    assert httpx.post(r.url + "/v1/completions", headers=auth(KEY_B),
                      json={"prompt": PROMPT, "max_tokens": 8}).status_code == 200


def _events(text: str) -> list:
    return [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]


@pytest.mark.parametrize("options,chunk_usage,final_usage", [
    (None, "absent", False),
    ({"include_usage": True}, "null", True),
    ({"include_usage": True, "continuous_usage_stats": True}, "present", True),
])
def test_streams_carry_only_the_usage_the_client_asked_for(fleet, options, chunk_usage, final_usage):
    r, _, _ = fleet
    body = {"prompt": PROMPT, "max_tokens": 8, "stream": True}
    if options:
        body["stream_options"] = options
    resp = httpx.post(r.url + "/v1/completions", json=body, headers=auth(KEY_C))
    assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
    events = _events(resp.text)
    chunks = [e for e in events if e["choices"]]
    assert len(chunks) == 8 and "".join(e["choices"][0]["text"] for e in chunks) == " tok" * 8
    for e in chunks:
        if chunk_usage == "absent":
            assert "usage" not in e
        elif chunk_usage == "null":
            assert e["usage"] is None
        else:
            assert e["usage"]["completion_tokens"] >= 1
    finals = [e for e in events if not e["choices"]]
    assert (len(finals) == 1 and finals[0]["usage"]["total_tokens"] == 28) if final_usage else not finals
    assert router_metric(r, "kvfleet_router_ratelimit_tokens_total", tenant="gamma", kind="used") == 28


def test_cancelled_stream_is_charged_what_it_generated(fleet):
    r, engine, _ = fleet
    body = {"prompt": PROMPT, "max_tokens": 8, "stream": True}
    with httpx.Client(timeout=10) as c, c.stream("POST", r.url + "/v1/completions", json=body,
                                                  headers={**auth(KEY_C), "x-fake-chunk-delay-ms": "150"}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {") and "tok" in line:
                break  # the first token arrived: hang up
    wait_for(lambda: router_metric(r, "kvfleet_router_ratelimit_reserved_tokens", tenant="gamma") == 0,
             what="settlement")
    used = router_metric(r, "kvfleet_router_ratelimit_tokens_total", tenant="gamma", kind="used")
    refunded = router_metric(r, "kvfleet_router_ratelimit_tokens_total", tenant="gamma", kind="refunded")
    assert 21 <= used <= 25, used  # 20 prompt tokens + the 1-5 generated before the engine saw the cancel
    assert used + refunded == 28
    wait_for(lambda: stats(engine)["cancelled"] == 1, what="the engine's abort")


def test_isolated_tenant_gets_its_own_cache_salt(fleet):
    """The fake engine's prefix cache is keyed on cache_salt: alpha's (forced) salt never matches gamma's."""
    r, engine, _ = fleet
    body = {"prompt": PROMPT * 4, "max_tokens": 8}
    hits = []
    for key, salt in ((KEY_C, None), (KEY_C, None), (KEY_A, None), (KEY_A, "client-salt"), (KEY_C, None)):
        before = stats(engine)["prefix_hits"]
        resp = httpx.post(r.url + "/v1/completions", headers=auth(key),
                          json={**body, **({"cache_salt": salt} if salt else {})})
        assert resp.status_code == 200
        hits.append(stats(engine)["prefix_hits"] - before)
    assert hits[0] == 0 and hits[1] > 0  # gamma hits its own cache
    assert hits[2] == 0  # alpha does not hit gamma's
    assert hits[3] > 0  # alpha's own salt wins over the client's: it hits alpha's cache
    assert hits[4] > 0


def test_tenants_file_reloads_without_restart(fleet):
    r, _, path = fleet
    assert httpx.post(r.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8},
                      headers=auth("sk-new-tenant-key")).status_code == 401
    path.write_text(TENANTS + f"""  delta:
    api_key_sha256: ["{key_sha256("sk-new-tenant-key")}"]
    tokens_per_minute: 1000
""")
    wait_for(lambda: httpx.post(r.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8},
                                headers=auth("sk-new-tenant-key")).status_code == 200, timeout=10,
             what="the reload")
    path.write_text("tenants: [not a mapping")  # a bad file: logged, the tenants in force stay
    time.sleep(2.5)
    assert httpx.post(r.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8},
                      headers=auth("sk-new-tenant-key")).status_code == 200
    assert router_metric(r, "kvfleet_router_tenants_reloads_total", result="failed") >= 1


def test_bad_tenants_file_stops_start_up_naming_the_line(procs, tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(f"tenants:\n  acme:\n    api_key_sha256: [{key_sha256('k')}]\n    tokens_per_minute: -5\n")
    r = router(procs, ["http://127.0.0.1:9"], "--tenants", str(path))
    r.popen.wait(timeout=30)
    assert r.popen.returncode == 2
    assert f"{path}:4" in r.tail() and "tokens_per_minute" in r.tail()


def test_redis_shared_budget_and_restart(procs, tmp_path, redis_server):
    """Two routers, one Redis: one budget. Redis killed: `closed` answers 503, `open` serves from local
    shares; restarted: shared budgets again, no crash."""
    engine = fake_engine(procs, "e1", "--chunks", "8").wait_ready()
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS)
    common = ["--tenants", str(path), "--redis-url", redis_server.url]
    r_open = router(procs, [engine.url], *common, "--ratelimit-on-store-error", "open",
                    policy="least-load").wait_ready()
    r_closed = router(procs, [engine.url], *common, "--ratelimit-on-store-error", "closed",
                      policy="least-load").wait_ready()
    body = {"prompt": PROMPT, "max_tokens": 40}  # 60 reserved, 28 used
    first = httpx.post(r_open.url + "/v1/completions", json=body, headers=auth(KEY_A))
    second = httpx.post(r_closed.url + "/v1/completions", json=body, headers=auth(KEY_A))
    assert first.status_code == second.status_code == 200
    assert first.headers["x-ratelimit-remaining-tokens"] == "540"
    assert 600 - 28 - 60 <= int(second.headers["x-ratelimit-remaining-tokens"]) <= 600 - 28 - 60 + 5  # shared
    redis_server.kill()
    assert httpx.post(r_closed.url + "/v1/completions", json=body, headers=auth(KEY_A)).status_code == 503
    assert httpx.post(r_open.url + "/v1/completions", json=body, headers=auth(KEY_A)).status_code == 200
    assert router_metric(r_closed, "kvfleet_router_ratelimit_store_errors_total") >= 1
    redis_server.start()
    wait_for(lambda: httpx.post(r_closed.url + "/v1/completions", json=body,
                                headers=auth(KEY_A)).status_code == 200, timeout=10, what="recovery")
    assert r_open.popen.poll() is None and r_closed.popen.poll() is None, r_open.tail() + r_closed.tail()


def test_failed_requests_are_refunded(fleet):
    r, _, _ = fleet
    for status in ("400", "500"):
        resp = httpx.post(r.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 40},
                          headers={**auth(KEY_A), "x-fake-status": status})
        assert resp.status_code == int(status)
    assert router_metric(r, "kvfleet_router_ratelimit_tokens_total", tenant="alpha", kind="used") == 0
    assert router_metric(r, "kvfleet_router_ratelimit_tokens_total", tenant="alpha", kind="refunded") == 120
    resp = httpx.post(r.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 40}, headers=auth(KEY_A))
    assert resp.headers["x-ratelimit-remaining-tokens"] == "540"  # the bucket is back to full before this one


def test_fleet_pressure_sheds_expensive_low_priority_requests(procs, tmp_path):
    engine = fake_engine(procs, "hot", "--kv-usage", "0.95", "--waiting", "3").wait_ready()
    path = tmp_path / "tenants.yaml"
    path.write_text(f"""
tenants:
  batch:
    api_key_sha256: ["{key_sha256(KEY_A)}"]
    tokens_per_minute: 1000000
  interactive:
    api_key_sha256: ["{key_sha256(KEY_B)}"]
    tokens_per_minute: 1000000
    priority: 5
""")
    r = router(procs, [engine.url], "--tenants", str(path), "--shed-min-cost-tokens", "1000",
               policy="least-load").wait_ready()
    wait_for(lambda: httpx.get(r.url + "/metrics").text.count("kvfleet_router_replica_ready") > 0, what="a scrape")
    time.sleep(0.5)  # scraped load (0.95 KV usage, 3 waiting: HIGH pressure) reaches the router
    big, small = {"prompt": PROMPT, "max_tokens": 2000}, {"prompt": PROMPT, "max_tokens": 100}
    shed = httpx.post(r.url + "/v1/completions", json=big, headers=auth(KEY_A))
    assert shed.status_code == 503 and shed.json()["error"]["code"] == "overloaded" and shed.headers["retry-after"]
    assert httpx.post(r.url + "/v1/completions", json=small, headers=auth(KEY_A)).status_code == 200
    assert httpx.post(r.url + "/v1/completions", json=big, headers=auth(KEY_B)).status_code == 200
    assert router_metric(r, "kvfleet_router_ratelimit_requests_total", tenant="batch", outcome="shed") == 1


def test_streams_cancelled_at_random_points_settle_exactly(fleet):
    """Five streams hung up after 0-6 chunks: each is charged 20 prompt tokens plus what it generated (at
    most the 8 it would have), the rest refunded; nothing stays reserved and the bucket is where the charges
    put it."""
    import random

    r, _, _ = fleet
    rng = random.Random(7)
    body = {"prompt": PROMPT, "max_tokens": 8, "stream": True}
    for _ in range(5):
        stop_after = rng.randint(0, 6)
        with httpx.Client(timeout=10) as c, c.stream("POST", r.url + "/v1/completions", json=body,
                                                      headers={**auth(KEY_C), "x-fake-chunk-delay-ms": "60"}) as resp:
            seen = 0
            for line in resp.iter_lines():
                if line.startswith("data: {") and "tok" in line:
                    seen += 1
                    if seen > stop_after:
                        break
    wait_for(lambda: router_metric(r, "kvfleet_router_ratelimit_reserved_tokens", tenant="gamma") == 0,
             what="settlement")
    reserved = router_metric(r, "kvfleet_router_ratelimit_tokens_total", tenant="gamma", kind="reserved")
    used = router_metric(r, "kvfleet_router_ratelimit_tokens_total", tenant="gamma", kind="used")
    refunded = router_metric(r, "kvfleet_router_ratelimit_tokens_total", tenant="gamma", kind="refunded")
    assert reserved == 5 * 28 and used + refunded == reserved
    assert 5 * 21 <= used < 5 * 28
    after = httpx.post(r.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8}, headers=auth(KEY_C))
    assert 100000 - used - 28 <= int(after.headers["x-ratelimit-remaining-tokens"]) <= 100000 - 28

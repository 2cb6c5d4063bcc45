"""Streams that move, against fake engines (loadtest/fake_engine.py: `x-fake-break-after` drops a stream after N
chunks, on the continuation too): one stream for the client, the limit, a 4xx refusal, stop strings without a
tokenizer, a client that went away. The exact continuation of a real model: test_migration.py."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from router.tenants.registry import key_sha256
from tests.router.conftest import fake_engine, metric, router, wait_for

CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "stream": True}


@pytest.fixture(scope="module")
def fakes(module_procs):
    a, b = fake_engine(module_procs, "a"), fake_engine(module_procs, "b")
    routers = {m: router(module_procs, [a.url, b.url], "--max-migrations", m, policy="least-load") for m in "12"}
    for p in (a, b, *routers.values()):
        p.wait_ready()
    for r in routers.values():
        wait_for(lambda r=r: httpx.get(r.url + "/ready").json().get("ready_replicas") == 2, what="both replicas")
    return a, b, routers


def stream(url: str, body: dict, headers: dict, after=None) -> tuple[str, list]:
    """(replica, events: parsed chunks and "[DONE]"); `after(replica)` runs once the response started."""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=10) as resp:
        assert resp.status_code == 200
        replica = resp.headers["x-kvfleet-replica"]
        if after is not None:
            after(replica)
        lines = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
    return replica, [ln if ln == "[DONE]" else json.loads(ln) for ln in lines]


def migrations(r, outcome: str) -> float:
    return metric(httpx.get(r.url + "/metrics").text, "kvfleet_router_migrations_total", outcome=outcome)


def other(fakes, replica: str):
    a, b, _ = fakes
    return b if replica == a.url else a


def test_a_stream_that_breaks_goes_on_elsewhere_as_one_stream(fakes):
    r = fakes[2]["2"]
    body = {**CHAT, "max_tokens": 8, "stream_options": {"include_usage": True}}
    replica, events = stream(r.url, body, {"x-fake-break-after": "5", "x-fake-chunk-delay-ms": "10"})
    chunks = [e for e in events[:-1] if e["choices"]]
    assert [e["choices"][0]["delta"].get("content") for e in chunks] == [" tok"] * 8
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1 and not any("error" in e for e in events[:-1])
    assert len({e["id"] for e in events[:-1]}) == 1  # one stream
    assert all("token_ids" not in e["choices"][0] and "prompt_token_ids" not in e for e in chunks)  # not asked
    # once, the whole request (the dead replica's cached tokens are unknown: it reported no usage before it died)
    assert events[-2]["usage"] == {"prompt_tokens": 8, "completion_tokens": 8, "total_tokens": 16}
    # the continuation: the prompt's 8 ids and the 5 generated, 3 tokens to go
    stats = httpx.get(other(fakes, replica).url + "/fake/stats").json()
    assert stats["last_prompt_tokens"] == 13 and stats["last_max_tokens"] == 3
    assert migrations(r, "completed") == 1


def test_at_most_max_migrations_then_the_error_event(fakes):
    r = fakes[2]["1"]
    _, events = stream(r.url, {**CHAT, "max_tokens": 20}, {"x-fake-break-after": "3", "x-fake-chunk-delay-ms": "5"})
    texts = [e["choices"][0]["delta"].get("content") for e in events[:-2]]
    assert texts == [" tok"] * 6  # 3 from the first replica, 3 from the second, which broke too
    assert "failed mid-stream" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
    assert migrations(r, "limit") == 1


def test_a_continuation_refused_with_a_4xx_is_not_retried(fakes):
    r = fakes[2]["2"]

    def refuse(replica):
        httpx.post(other(fakes, replica).url + "/fake/set?fail_status=400")

    try:
        _, events = stream(r.url, {**CHAT, "max_tokens": 8},
                           {"x-fake-break-after": "3", "x-fake-chunk-delay-ms": "100"}, after=refuse)
    finally:
        for f in fakes[:2]:
            httpx.post(f.url + "/fake/set?fail_status=0")
    assert len(events) == 5 and "error" in events[3] and events[4] == "[DONE]"
    assert migrations(r, "failed") == 1


def test_stop_strings_need_the_routers_tokenizer(fakes):
    r = fakes[2]["2"]  # started without --model: no tokenizer to find text the replica held back
    _, events = stream(r.url, {**CHAT, "max_tokens": 8, "stop": ["zzz"]}, {"x-fake-break-after": "3"})
    assert "error" in events[-2] and events[-1] == "[DONE]"
    assert migrations(r, "unsupported") == 1


def test_a_client_that_went_away_is_not_moved(fakes):
    r = fakes[2]["2"]
    before = {f.url: httpx.get(f.url + "/fake/stats").json()["requests"] for f in fakes[:2]}
    moved = sum(migrations(r, o) for o in ("completed", "limit", "failed", "unsupported"))
    with httpx.stream("POST", r.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 50}, timeout=10,
                      headers={"x-fake-break-after": "4", "x-fake-chunk-delay-ms": "100"}) as resp:
        replica = resp.headers["x-kvfleet-replica"]
        next(resp.iter_lines())
    time.sleep(0.8)  # past the break the replica would have made
    after = {f.url: httpx.get(f.url + "/fake/stats").json()["requests"] for f in fakes[:2]}
    assert after[other(fakes, replica).url] == before[other(fakes, replica).url]  # no continuation sent
    assert sum(migrations(r, o) for o in ("completed", "limit", "failed", "unsupported")) == moved


def test_a_stream_that_breaks_after_its_last_token_ends_without_a_new_request(fakes):
    r = fakes[2]["2"]  # max_tokens reached: nothing to continue; the router ends the stream itself
    before = sum(httpx.get(f.url + "/fake/stats").json()["requests"] for f in fakes[:2])
    _, events = stream(r.url, {**CHAT, "max_tokens": 4, "stream_options": {"include_usage": True}},
                       {"x-fake-break-after": "4"})
    assert [e["choices"][0]["finish_reason"] for e in events[:4]] == [None, None, None, "length"]
    assert events[4]["usage"]["completion_tokens"] == 4 and events[5] == "[DONE]" and len(events) == 6
    assert sum(httpx.get(f.url + "/fake/stats").json()["requests"] for f in fakes[:2]) == before + 1


def test_an_error_event_of_a_failed_replica_moves_the_stream_and_a_4xx_one_does_not(fakes, procs):
    # a router of its own: the breaks of the tests above opened the others' circuit breakers
    r = router(procs, [f.url for f in fakes[:2]], policy="least-load").wait_ready()
    wait_for(lambda: httpx.get(r.url + "/ready").json().get("ready_replicas") == 2, what="both replicas")
    completed, failed = migrations(r, "completed"), migrations(r, "failed")
    _, events = stream(r.url, {**CHAT, "max_tokens": 6}, {"x-fake-error-after": "4"})  # 503: its core died
    assert [e["choices"][0]["delta"].get("content") for e in events[:-1]] == [" tok"] * 6 and events[-1] == "[DONE]"
    assert migrations(r, "completed") == completed + 1
    _, events = stream(r.url, {**CHAT, "max_tokens": 6}, {"x-fake-error-after": "4", "x-fake-error-status": "400"})
    assert len(events) == 6 and events[4]["error"]["type"] == "invalid_request_error" and events[5] == "[DONE]"
    assert migrations(r, "completed") == completed + 1 and migrations(r, "failed") == failed  # not a break


def test_a_tenants_budget_is_charged_the_whole_request_once(fakes, procs, tmp_path):
    key = "sk-moving-Qx81mXr0"
    path = tmp_path / "tenants.yaml"
    path.write_text(f"tenants:\n  t:\n    api_key_sha256: [\"{key_sha256(key)}\"]\n    tokens_per_minute: 100000\n")
    r = router(procs, [f.url for f in fakes[:2]], "--tenants", str(path), policy="least-load").wait_ready()
    wait_for(lambda: httpx.get(r.url + "/ready").json().get("ready_replicas") == 2, what="both replicas")
    body = {"model": "smollm2", "prompt": list(range(100, 120)), "max_tokens": 8, "stream": True}
    with httpx.stream("POST", r.url + "/v1/completions", json=body, timeout=10,
                      headers={"authorization": f"Bearer {key}", "x-fake-break-after": "5"}) as resp:
        events = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert len(events) == 9 and events[-1] == "[DONE]"
    assert all('"usage"' not in e and "token_ids" not in e for e in events)  # the client asked for neither
    used = lambda: metric(httpx.get(r.url + "/metrics").text, "kvfleet_router_ratelimit_tokens_total",  # noqa: E731
                          tenant="t", kind="used")
    wait_for(lambda: used() > 0, what="settlement")
    assert used() == 20 + 8  # the prompt once, every generated token once (5 before the break, 3 after)
    assert migrations(r, "completed") == 1

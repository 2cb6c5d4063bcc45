"""The fair queue in a real router process (`--replica-slots`), in front of a fake engine that serves two
requests at a time and queues the rest first come, first served (`--max-running 2`, like max_num_seqs): a
tenant's flood does not hold up another tenant's request; a request cancelled while queued reaches no engine and
keeps no reservation; full queues get 429 and long waits 503, both with Retry-After."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from router.tenants.registry import key_sha256
from tests.router.conftest import fake_engine, metric, router, wait_for

KEY_A, KEY_B = "sk-flood-a", "sk-steady-b"
TENANTS = f"""
tenants:
  a:
    api_key_sha256: ["{key_sha256(KEY_A)}"]
    tokens_per_minute: 10000000
  b:
    api_key_sha256: ["{key_sha256(KEY_B)}"]
    tokens_per_minute: 10000000
    priority: 2
"""
SLOW = {"x-fake-chunk-delay-ms": "40"}  # 8 chunks: ~0.3 s a request


def body(stream=True):
    return {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "stream": stream}


async def _flood_then_one(url: str, flood: int, engine_url: str) -> tuple[float, list[int]]:
    """A sends `flood` requests at once; once they fill the engine, B sends one: (B's latency, A's statuses)."""
    async with httpx.AsyncClient(timeout=60) as c:
        async def one(key):
            t0 = time.perf_counter()
            r = await c.post(url + "/v1/chat/completions", json=body(), headers={"authorization": f"Bearer {key}",
                                                                                 **SLOW})
            return r.status_code, time.perf_counter() - t0
        flood_tasks = [asyncio.create_task(one(KEY_A)) for _ in range(flood)]
        await until(lambda: engine_running(engine_url) == 2, "A's flood on both engine slots")
        status_b, latency_b = await one(KEY_B)
        assert status_b == 200
        return latency_b, [s for s, _ in await asyncio.gather(*flood_tasks)]


async def until(cond, what: str, timeout: float = 10.0) -> None:
    """Poll `cond()` (a blocking check, run off the loop) until it holds."""
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(cond):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def queued(url: str, **labels) -> float:
    return metric(httpx.get(url + "/metrics").text, "kvfleet_router_queued_requests", **labels)


def engine_running(url: str) -> int:
    return httpx.get(url + "/fake/stats").json()["running"]


@pytest.fixture
def tenants_file(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS)
    return str(path)


def test_a_flood_does_not_hold_up_another_tenant(procs, tenants_file):
    e = fake_engine(procs, "e", "--max-running", "2").wait_ready()
    fifo = router(procs, [e.url], "--tenants", tenants_file, policy="least-load").wait_ready()
    fair = router(procs, [e.url], "--tenants", tenants_file, "--replica-slots", "2", policy="least-load").wait_ready()
    b_fifo, a_fifo = asyncio.run(_flood_then_one(fifo.url, 16, e.url))
    b_fair, a_fair = asyncio.run(_flood_then_one(fair.url, 16, e.url))
    assert set(a_fifo) == set(a_fair) == {200}  # A is served in full either way
    # FCFS: B waits behind A's 16 (8 rounds of ~0.3 s); fair: B goes at the next free slot
    assert b_fifo > 2.0 and b_fair < 1.0, (b_fifo, b_fair)
    text = httpx.get(fair.url + "/metrics").text
    assert metric(text, "kvfleet_router_queue_wait_seconds_count") >= 8  # most of the flood waited
    assert metric(text, "kvfleet_router_queued_requests") == 0


def test_cancelled_while_queued_reaches_no_engine_and_keeps_no_reservation(procs, tenants_file):
    e = fake_engine(procs, "e", "--max-running", "1").wait_ready()
    r = router(procs, [e.url], "--tenants", tenants_file, "--replica-slots", "1", policy="least-load").wait_ready()

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            hold = asyncio.create_task(c.post(r.url + "/v1/chat/completions", json=body(),
                                              headers={"authorization": f"Bearer {KEY_A}",
                                                       "x-fake-chunk-delay-ms": "250"}))
            await until(lambda: engine_running(e.url) == 1, "A on the engine's one slot")
            waiting = asyncio.create_task(c.post(r.url + "/v1/chat/completions", json=body(),
                                                 headers={"authorization": f"Bearer {KEY_B}"}))
            await until(lambda: queued(r.url, tenant="b") == 1, "B queued")
            waiting.cancel()  # the client goes away while its request waits
            await until(lambda: metric(httpx.get(r.url + "/metrics").text, "kvfleet_router_queue_refusals_total",
                                       reason="cancelled") == 1, "B out of the queue")
            assert (await hold).status_code == 200

    asyncio.run(run())
    text = httpx.get(r.url + "/metrics").text
    assert metric(text, "kvfleet_router_queue_refusals_total", reason="cancelled") == 1
    assert metric(text, "kvfleet_router_ratelimit_reserved_tokens", tenant="b") == 0
    assert httpx.get(e.url + "/fake/stats").json()["requests"] == 1  # only A's reached the engine


def test_full_queues_and_long_waits_are_refused_with_retry_after(procs, tenants_file):
    e = fake_engine(procs, "e", "--max-running", "1").wait_ready()
    r = router(procs, [e.url], "--tenants", tenants_file, "--replica-slots", "1", "--queue-max-per-tenant", "1",
               "--queue-timeout", "0.5", policy="least-load").wait_ready()

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            def post(key, delay="0"):
                return c.post(r.url + "/v1/chat/completions", json=body(),
                              headers={"authorization": f"Bearer {key}", "x-fake-chunk-delay-ms": delay})
            hold = asyncio.create_task(post(KEY_A, "200"))  # ~1.6 s on the one slot
            await until(lambda: engine_running(e.url) == 1, "A on the engine's one slot")
            waits = asyncio.create_task(post(KEY_B))
            await until(lambda: queued(r.url, tenant="b") == 1, "B queued")
            full = await post(KEY_B)  # B already has one queued: its limit
            assert full.status_code == 429 and full.headers["retry-after"] == "1"
            assert full.json()["error"]["code"] == "queue_full"
            timed_out = await waits
            assert timed_out.status_code == 503 and timed_out.headers["retry-after"] == "1"
            assert timed_out.json()["error"]["code"] == "queue_timeout"
            assert (await hold).status_code == 200

    asyncio.run(run())
    wait_for(lambda: metric(httpx.get(r.url + "/metrics").text, "kvfleet_router_ratelimit_reserved_tokens") == 0,
             what="every reservation settled")


def test_the_tenants_priority_goes_upstream_as_the_engines_priority(procs, tenants_file):
    e = fake_engine(procs, "e").wait_ready()
    r = router(procs, [e.url], "--tenants", tenants_file, "--forward-priority", policy="least-load").wait_ready()

    def sent(key, **fields) -> object:
        resp = httpx.post(r.url + "/v1/chat/completions", json={**body(False), **fields},
                          headers={"authorization": f"Bearer {key}"})
        assert resp.status_code == 200
        return httpx.get(e.url + "/fake/stats").json()["last_priority"]

    assert sent(KEY_B) == -2  # tenant priority 2 (higher first) is engine priority -2 (lower first)
    assert sent(KEY_B, priority=5) == 5  # the client's own stays
    assert sent(KEY_A) is None  # priority 0: nothing to send

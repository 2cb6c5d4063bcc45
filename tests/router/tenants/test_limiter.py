"""router/tenants/limiter.py against a real redis-server that is killed and restarted mid-run: `closed` raises
LimiterUnavailable, `open` falls back to this router's share; both come back to Redis with correct budgets,
log once per transition and count every store error."""

from __future__ import annotations

import asyncio
import logging

import pytest

from router.tenants.budget import Bucket, BudgetSpec, Quota, Reason
from router.tenants.limiter import Limiter, LimiterUnavailable, OnStoreError
from router.tenants.redis_store import RedisStore
from router.tenants.store import InProcessStore, Rejection, StoreError

SPEC = BudgetSpec(600, max_concurrent_requests=4)  # C = 600, r = 10/s


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def transitions(caplog) -> list[str]:
    return [r.getMessage().split(";")[0] for r in caplog.records if r.name == "kvfleet.router.limiter"]


def test_closed_raises_while_redis_is_down_and_recovers_after_restart(redis_server, caplog):
    caplog.set_level(logging.WARNING, "kvfleet.router.limiter")
    clock, seen = Clock(), []

    async def scenario():
        limiter = Limiter(RedisStore.from_url(redis_server.url), OnStoreError.CLOSED, clock=clock,
                          on_store_error=seen.append)
        before = await limiter.reserve("t", SPEC, 100, now=0.0)
        assert before.quota == Quota(600, 500, 10.0) and not before.local
        redis_server.kill()
        for _ in range(3):
            with pytest.raises(LimiterUnavailable):
                await limiter.reserve("t", SPEC, 100, now=1.0)
        assert (limiter.healthy, limiter.store_errors) == (False, 1)  # not retried before retry_s
        assert await limiter.settle(before, 50, now=1.0) is None  # dropped, not raised
        clock.t += 1.0
        assert await limiter.settle(before, 50, now=1.0) is None
        assert limiter.store_errors == 2 and all(isinstance(e, StoreError) for e in seen) and len(seen) == 2
        redis_server.start()
        clock.t += 1.0
        after = await limiter.reserve("t", SPEC, 100, now=2.0)
        assert limiter.healthy
        assert after.quota == Quota(600, 500, 10.0)  # Redis came back empty: a full bucket
        assert await limiter.settle(after, 40, now=3.0) == Quota(600, 570, 3.0)  # 500 + 10, + 60
        assert (await limiter.store.state("t"))[0] == Bucket(570.0, 3.0)
        await limiter.store.close()

    asyncio.run(scenario())
    assert [m.split(" (")[0] for m in transitions(caplog)] == ["rate-limit store failing",
                                                               "rate-limit store healthy again after 2 errors"]


def test_open_falls_back_to_this_routers_share_and_drops_it_after_recovery(redis_server, caplog):
    caplog.set_level(logging.WARNING, "kvfleet.router.limiter")
    clock = Clock()

    async def scenario():
        limiter = Limiter(RedisStore.from_url(redis_server.url), OnStoreError.OPEN, routers=2, clock=clock)
        shared = await limiter.reserve("t", SPEC, 100, now=0.0)
        redis_server.kill()
        a = await limiter.reserve("t", SPEC, 200, now=1.0)  # local: C = 300, r = 5/s, 2 slots
        assert a.local and a.spec == BudgetSpec(300.0, 2, 600.0) and a.quota == Quota(300, 100, 40.0)
        assert await limiter.reserve("t", SPEC, 200, now=1.0) == Rejection("t", Reason.TOKENS, 20.0,
                                                                           Quota(300, 100, 40.0))
        assert (await limiter.reserve("t", SPEC, 601, now=1.0)).reason is Reason.TOO_LARGE
        b = await limiter.reserve("t", SPEC, 50, now=1.0)
        assert (await limiter.reserve("t", SPEC, 1, now=1.0)).reason is Reason.CONCURRENCY
        assert await limiter.settle(a, 0, now=3.0) == Quota(300, 260, 8.0)  # 50 + 10, + 200
        assert await limiter.settle(shared, 0, now=3.0) is None  # shared reservation: dropped while down
        assert limiter.store_errors == 1
        redis_server.start()
        clock.t += 1.0
        c = await limiter.reserve("t", SPEC, 100, now=4.0)
        assert not c.local and c.quota == Quota(600, 500, 10.0)  # Redis again, fresh after its restart
        assert await limiter.settle(b, 0, now=4.0) is None  # the local state was dropped
        assert (await limiter.store.state("t"))[0] == Bucket(500.0, 4.0)
        await limiter.store.close()

    asyncio.run(scenario())
    assert [m.split(" (")[0] for m in transitions(caplog)] == ["rate-limit store failing",
                                                               "rate-limit store healthy again after 1 errors"]


def test_heartbeats_set_the_share_and_survive_an_outage(redis_server):
    async def scenario():
        one = Limiter(RedisStore.from_url(redis_server.url), OnStoreError.OPEN, retry_s=0.0)
        two = Limiter(RedisStore.from_url(redis_server.url), OnStoreError.OPEN)
        assert await one.heartbeat("r1", 10.0) == 1
        assert await two.heartbeat("r2", 10.0) == 2
        assert await one.heartbeat("r1", 10.0) == 2 and one.live_routers() == 2
        redis_server.kill()
        assert await one.heartbeat("r1", 10.0) == 2 and one.store_errors == 1 and not one.healthy
        got = await one.reserve("t", SPEC, 10, now=0.0)
        assert got.local and got.quota.limit == 300
        redis_server.start()
        assert await one.heartbeat("r1", 10.0) == 1 and one.healthy
        for limiter in (one, two):
            await limiter.store.close()

    asyncio.run(scenario())


def test_in_process_store_has_no_heartbeats():
    async def scenario():
        limiter = Limiter(InProcessStore(), routers=3)
        assert await limiter.heartbeat("r1", 10.0) == 3
        got = await limiter.reserve("t", SPEC, 10, now=0.0)
        assert not got.local and got.quota == Quota(600, 590, 1.0)

    asyncio.run(scenario())


@pytest.mark.parametrize("policy", list(OnStoreError))
def test_redis_restarted_under_load(redis_server, policy):
    """Workers reserve and settle (using nothing) while Redis is killed and restarted: only LimiterUnavailable
    ever surfaces, and afterwards every shared reservation has been refunded and no lease is left."""
    spec = BudgetSpec(6_000_000, max_concurrent_requests=64)
    counts = {"shared": 0, "local": 0, "unavailable": 0, "rejected": 0}

    async def worker(limiter, stop):
        while not stop.is_set():
            try:
                got = await limiter.reserve("t", spec, 1000)
            except LimiterUnavailable:
                counts["unavailable"] += 1
                await asyncio.sleep(0.005)
                continue
            if isinstance(got, Rejection):
                counts["rejected"] += 1
                continue
            counts["local" if got.local else "shared"] += 1
            await asyncio.sleep(0.002)
            await limiter.settle(got, 0)

    async def scenario():
        limiter = Limiter(RedisStore.from_url(redis_server.url), policy, retry_s=0.05)
        stop = asyncio.Event()
        tasks = [asyncio.create_task(worker(limiter, stop)) for _ in range(8)]
        await asyncio.sleep(0.3)
        await asyncio.to_thread(redis_server.kill)
        await asyncio.sleep(0.3)
        await asyncio.to_thread(redis_server.start)
        await asyncio.sleep(0.3)
        stop.set()
        await asyncio.gather(*tasks)
        assert limiter.healthy
        bucket, leases = await limiter.store.state("t")
        assert bucket.level == spec.capacity and len(leases) == 0
        await limiter.store.close()
        return limiter.store_errors

    errors = asyncio.run(scenario())
    assert errors >= 1 and counts["shared"] > 0 and counts["rejected"] == 0
    assert counts["local" if policy is OnStoreError.OPEN else "unavailable"] > 0
    assert counts["unavailable" if policy is OnStoreError.OPEN else "local"] == 0


class FlakyStore(InProcessStore):
    """An in-process store that fails on demand, or blocks until `gate` is set (the limiter's policy, not
    Redis, is under test here)."""

    def __init__(self):
        super().__init__()
        self.failing, self.calls, self.gate = False, 0, asyncio.Event()
        self.gate.set()

    async def reserve(self, tenant, spec, amount, now=None, pending=None):
        self.calls += 1
        await self.gate.wait()
        if self.failing:
            raise StoreError("down")
        return await super().reserve(tenant, spec, amount, now, pending)


def test_one_probe_at_a_time_and_a_cancelled_probe_does_not_wedge_the_limiter():
    clock = Clock()

    async def scenario():
        store = FlakyStore()
        limiter = Limiter(store, OnStoreError.OPEN, clock=clock)
        store.failing = True
        assert (await limiter.reserve("t", SPEC, 1, now=0.0)).local and store.calls == 1
        clock.t += 1.0
        store.gate.clear()
        probe = asyncio.create_task(limiter.reserve("t", SPEC, 1, now=0.0))
        await asyncio.sleep(0)
        assert store.calls == 2
        assert (await limiter.reserve("t", SPEC, 1, now=0.0)).local and store.calls == 2  # not a second probe
        probe.cancel()
        with pytest.raises(asyncio.CancelledError):
            await probe
        store.failing = False
        store.gate.set()
        got = await limiter.reserve("t", SPEC, 1, now=0.0)
        assert not got.local and store.calls == 3 and limiter.healthy

    asyncio.run(scenario())

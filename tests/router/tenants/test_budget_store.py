"""Budget stores: the in-process store and the Redis store (a real redis-server) give router/tenants/budget.py's
numbers exactly, hold concurrency leases that expire, and expire idle tenants' keys."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from router.tenants.budget import CONCURRENCY_RETRY_S, Bucket, BudgetSpec, Quota, Reason
from router.tenants.redis_store import RedisStore
from router.tenants.store import InProcessStore, Rejection, Reservation

SPEC = BudgetSpec(600, max_concurrent_requests=2)  # C = 600, r = 10/s


def run(scenario, redis_url: str | None):
    """Run `scenario(store)` on a fresh store: in-process when `redis_url` is None."""

    async def main():
        store = InProcessStore(lease_s=30.0) if redis_url is None else RedisStore.from_url(redis_url, lease_s=30.0)
        try:
            return await scenario(store)
        finally:
            if redis_url is not None:
                await store.close()

    return asyncio.run(main())


@pytest.fixture(params=["inprocess", "redis"])
def url(request):
    return None if request.param == "inprocess" else request.getfixturevalue("redis_server").url


def test_reserve_settle_refund_and_debt(url):
    async def scenario(store):
        a = await store.reserve("t", SPEC, 400, now=100.0)
        assert a == Reservation("t", SPEC, 400, a.lease_id, Quota(600, 200, 40.0))
        b = await store.reserve("t", SPEC, 150, now=101.0)
        assert b.quota == Quota(600, 60, 54.0)
        assert await store.settle(a, 350, now=102.5) == Quota(600, 125, 47.5)  # 75 + 50
        r = await store.reserve("t", SPEC, 300, now=103.0)
        assert r == Rejection("t", Reason.TOKENS, 17.0, Quota(600, 130, 47.0))
        assert await store.settle(b, 900, now=103.0) == Quota(600, 0, 122.0)  # 130 - 750 = -620: debt
        bucket, _ = await store.state("t")
        assert bucket == Bucket(-620.0, 103.0)
        r = await store.reserve("t", SPEC, 10, now=104.0)
        assert r == Rejection("t", Reason.TOKENS, 62.0, Quota(600, 0, 121.0))
        assert isinstance(await store.reserve("t", SPEC, 10, now=166.0), Reservation)

    run(scenario, url)


def test_too_large_is_never_admitted(url):
    async def scenario(store):
        assert await store.reserve("t", SPEC, 601, now=0.0) == Rejection("t", Reason.TOO_LARGE, None,
                                                                          Quota(600, 600, 0.0))
        assert (await store.reserve("t", SPEC, 600, now=0.0)).quota == Quota(600, 0, 60.0)

    run(scenario, url)


def test_concurrency_leases_are_released_by_settle_or_expiry(url):
    async def scenario(store):
        a = await store.reserve("t", SPEC, 10, now=0.0)
        b = await store.reserve("t", SPEC, 10, now=1.0)
        assert a.lease_id and b.lease_id and a.lease_id != b.lease_id
        c = await store.reserve("t", SPEC, 10, now=2.0)
        assert (c.reason, c.retry_after_s, c.quota.remaining) == (Reason.CONCURRENCY, CONCURRENCY_RETRY_S, 600)
        await store.settle(a, 10, now=2.0)
        c = await store.reserve("t", SPEC, 10, now=2.0)
        assert isinstance(c, Reservation)
        _, leases = await store.state("t")
        assert sorted(e for _, e in leases.held) == [31.0, 32.0]
        assert isinstance(await store.reserve("t", SPEC, 10, now=30.5), Rejection)
        d = await store.reserve("t", SPEC, 10, now=31.0)  # b (expiry 31) no longer counts: a dead router
        assert isinstance(d, Reservation)
        await store.settle(b, 10, now=40.0)  # settling an expired lease still settles the tokens
        bucket, leases = await store.state("t")
        assert bucket == Bucket(600.0, 40.0)
        assert sorted(e for _, e in leases.live(40.0).held) == [61.0]

    run(scenario, url)


def test_unlimited_concurrency_takes_no_lease(url):
    async def scenario(store):
        spec = BudgetSpec(600)
        got = [await store.reserve("t", spec, 1, now=0.0) for _ in range(5)]
        assert all(isinstance(g, Reservation) and g.lease_id is None for g in got)
        assert len((await store.state("t"))[1]) == 0

    run(scenario, url)


def _random_ops(seed: int):
    """A random interleaving of reserve / settle over three tenants and uneven time steps."""
    rng = random.Random(seed)
    specs = {"a": BudgetSpec(1000, 3), "b": BudgetSpec(777).share(3), "c": BudgetSpec(60_000, 2).share(2)}
    now, ops = 1.7e9 + rng.random(), []
    for _ in range(150):
        now += rng.choice([0.0, rng.uniform(0, 0.5), rng.uniform(0, 7)])
        tenant = rng.choice(list(specs))
        if rng.random() < 0.55:
            cap = specs[tenant].max_request
            amount = rng.randint(0, int(cap * rng.choice([0.1, 0.1, 1.05])))
            ops.append(("reserve", tenant, specs[tenant], amount, now))
        else:
            ops.append(("settle", tenant, rng.random(), rng.uniform(0, 1.5), now))
    return ops


async def _play(store, ops) -> list:
    """Apply `ops`; record every result and the state after it (lease ids replaced by expiries)."""
    held: list[Reservation] = []
    trace = []
    for op in ops:
        if op[0] == "reserve":
            _, tenant, spec, amount, now = op
            got = await store.reserve(tenant, spec, amount, now=now)
            if isinstance(got, Reservation):
                held.append(got)
                trace.append(("admitted", got.amount, got.quota))
            else:
                trace.append(("rejected", got.reason, got.retry_after_s, got.quota))
        else:
            _, tenant, pick, usage, now = op
            mine = [r for r in held if r.tenant == tenant]
            if not mine:
                continue
            r = mine[int(pick * len(mine))]
            held.remove(r)
            trace.append(("settled", await store.settle(r, int(r.amount * usage), now=now)))
        bucket, leases = await store.state(op[1])
        trace.append((bucket, sorted(e for _, e in leases.live(op[-1]).held)))
    return trace


@pytest.mark.parametrize("seed", range(6))
def test_redis_gives_the_same_numbers_as_the_pure_arithmetic(redis_server, seed):
    ops = _random_ops(seed)
    expected = run(lambda s: _play(s, ops), None)
    got = run(lambda s: _play(s, ops), redis_server.url)
    kinds = {t[0] for t in expected if isinstance(t[0], str)}
    assert {"admitted", "rejected", "settled"} <= kinds
    assert any(b is not None and b.level < 0 for b, *_ in expected if isinstance(b, Bucket))  # debts too
    assert got == expected


def test_redis_keys_carry_ttls_and_use_redis_time(redis_server):
    async def scenario(store):
        await store.reserve("t", SPEC, 300, now=None)
        bucket, leases = await store.state("t")
        assert abs(bucket.updated - time.time()) < 5  # Redis TIME, not an injected clock
        bucket_key, leases_key = store.keys("t")[:2]
        assert bucket_key == "kvfleet:budget:{t}"
        assert 60_000 < await store.client.pttl(bucket_key) <= 90_000  # full again in 30 s, plus 60 s margin
        assert 60_000 < await store.client.pttl(leases_key) <= 90_000  # lease_s 30 + margin 60

    run(scenario, redis_server.url)


def test_redis_scripts_are_reloaded_after_a_script_flush(redis_server):
    async def scenario(store):
        await store.reserve("t", SPEC, 100, now=0.0)
        await store.client.script_flush()
        got = await store.reserve("t", SPEC, 100, now=0.0)
        assert got.quota.remaining == 400

    run(scenario, redis_server.url)


def test_heartbeats_count_live_routers(redis_server):
    async def scenario(store):
        assert await store.heartbeat("r1", 0.3) == 1
        assert await store.heartbeat("r2", 5.0) == 2
        assert await store.heartbeat("r2", 5.0) == 2
        await asyncio.sleep(0.4)
        return await store.heartbeat("r2", 5.0)

    assert run(scenario, redis_server.url) == 1


def test_redis_ledger_records_once_and_closes_what_no_router_settled(redis_server):
    """A pending record is written with the reservation and removed with the settle; the replica is attached to it;
    past its deadline it is due, and closing it (router/tenants/pending.py) refunds what the engine did not use and
    appends its record, once, however many routers close it at once; a request settled after that changes nothing
    and adds no second record. Every append of a request id already recorded is a no-op. The charged counter is
    the sum of the ledger's budget_tokens throughout."""
    import json as _json

    from router.tenants import ledger
    from router.tenants.pending import Close

    def rec(rid: str, outcome: str, budget: int = 100) -> str:
        return ledger.record(rid, "t", None, "m", "default", None, None, budget, None, outcome, 1.0, 0.0,
                             None).to_json()

    async def scenario(store):
        store.reconcile_after_s = 0.2
        spec = BudgetSpec(600)
        settled = await store.reserve("t", spec, 100, pending=("req_a", rec("req_a", "router_lost")))
        lost = await store.reserve("t", spec, 100, pending=("req_b", rec("req_b", "router_lost")))
        late = await store.reserve("t", spec, 100, pending=("req_c", rec("req_c", "router_lost")))
        assert lost.pending_id == "req_b"
        await store.attach("t", "req_b", "http://127.0.0.1:1")
        await store.attach("t", "req_b", "http://127.0.0.1:2")  # a retry elsewhere: the last one counts
        await store.settle(settled, 30, record=rec("req_a", "200", 30))
        await store.attach("t", "req_a", "http://127.0.0.1:1")  # settled already: nothing comes back
        assert await store.due("t") == []  # not due yet
        await asyncio.sleep(0.3)
        due = {p.request_id: p for p in await store.due("t")}
        assert set(due) == {"req_b", "req_c"} and set(await store.client.hkeys(store.keys("t")[4])) == {
            b"req_b", b"req_c"}  # due, and left in place
        assert due["req_b"].replica == "http://127.0.0.1:2" and due["req_c"].replica is None
        assert due["req_b"].record.budget_tokens == 100
        closes = [Close("req_b", 100, 40, rec("req_b", "router_lost_settled", 40), "router_lost_settled"),
                  Close("req_c", 100, 100, rec("req_c", "router_lost"), "router_lost")]
        before, _ = await store.state("t")
        two = await asyncio.gather(store.close_pending("t", spec, closes), store.close_pending("t", spec, closes))
        assert sorted(two) == [0, 2]  # two routers closing at once: one of them closes both
        after, _ = await store.state("t")
        assert after.level == pytest.approx(before.level + 60 + (after.updated - before.updated) * 10)  # refund 60
        await store.settle(late, 10, record=rec("req_c", "200", 10))  # settled after its record was closed
        late_state, _ = await store.state("t")
        assert late_state.level <= after.level + 1e-6 + (late_state.updated - after.updated) * 10  # only refill
        await store.append("t", [rec("req_a", "200", 30)])  # sent again (a settle that timed out but ran): no-op
        rows = [_json.loads(r) for r in await store.records("t", 0, time.time() + 5)]
        assert sorted((r["request_id"], r["outcome"], r["budget_tokens"]) for r in rows) == [
            ("req_a", "200", 30), ("req_b", "router_lost_settled", 40), ("req_c", "router_lost", 100)]
        assert await store.client.hlen(store.keys("t")[4]) == 0  # no pending record left
        assert await store.charged("t") == sum(r["budget_tokens"] for r in rows) == 170

    run(scenario, redis_server.url)

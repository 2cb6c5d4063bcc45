"""Redis outage: Redis (the token budgets every router shares) is killed under load and started again, empty.

The fleet's routers run `--ratelimit-on-store-error open` (the default: local limits while Redis is down);
an extra router runs `closed` (503 while it is down). Pass: open routers keep answering 200; the closed one
answers 503 with the store's error body (never another 5xx, never a crash); afterwards every router finds
Redis again within the bound, holds no reservation at idle, and a small tenant's budget is enforced once
across both routers (it is shared again, not counted per router).
"""

from __future__ import annotations

import asyncio
import time

import httpx

from loadtest.chaos.clients import Tally, chat_body, request
from loadtest.chaos.common import Options, client
from loadtest.chaos.fleet import KEYS, SMALL_BUDGET, Fleet, metric
from loadtest.chaos.load import Load
from loadtest.chaos.verdict import Verdict

NAME = "Redis outage"
RECOVERY_BOUND_S = 10.0


def _healthy(fleet: Fleet, routers) -> bool:
    try:
        return all(metric(fleet.router_metrics(r), "kvfleet_router_ratelimit_store_healthy") == 1 for r in routers)
    except httpx.HTTPError:
        return False


async def run(fleet: Fleet, opts: Options) -> Verdict:
    v = Verdict(NAME)
    closed = fleet.start_extra_router("router-closed", "--ratelimit-on-store-error", "closed")
    routers = [*fleet.routers, closed]
    open_load = await Load([r.url for r in fleet.routers], workers=4, seed=opts.seed + 4).start()
    closed_load = await Load([closed.url], workers=2, seed=opts.seed + 5).start()
    await asyncio.sleep(3)
    n_open0, n_closed0 = open_load.tally.n, closed_load.tally.n
    fleet.redis.kill()
    outage = opts.scale(15, 6)
    await asyncio.sleep(outage)
    during_open = open_load.tally.results[n_open0:]
    during_closed = closed_load.tally.results[n_closed0:]
    fleet.redis.start()
    t_back = time.monotonic()
    recovered = None
    while time.monotonic() - t_back < 30:
        if await asyncio.to_thread(_healthy, fleet, routers):
            recovered = round(time.monotonic() - t_back, 2)
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(2)
    t_open, t_closed = await open_load.stop(), await closed_load.stop()
    d_open, d_closed = Tally(during_open), Tally(during_closed)
    v.figures["outage (s)"] = outage
    v.figures["open routers during the outage: statuses"] = d_open.statuses()
    v.figures["closed router during the outage: statuses"] = d_closed.statuses()
    v.figures["routers find Redis again after (s)"] = recovered
    v.check("open: requests keep being served", d_open.n > 0 and d_open.ok == d_open.n,
            f"{d_open.n - d_open.ok} of {d_open.n} failed during the outage")
    wrong = [r for r in d_closed.results if not r.ok and not (r.status == 503 and "store" in (r.error or ""))]
    v.check("closed: 503 with the store's error, nothing else fails",
            d_closed.count(lambda r: r.status == 503) > 0 and not wrong,
            f"{d_closed.count(lambda r: r.status == 503)} x 503; other failures: {len(wrong)}")
    other_5xx = [r for r in (*t_open.results, *t_closed.results) if r.server_error and "store" not in (r.error or "")]
    v.check("no other 5xx, no hung request", not other_5xx and t_open.hung + t_closed.hung == 0,
            f"{len(other_5xx)} other 5xx, {t_open.hung + t_closed.hung} hung")
    v.check("no router crashed", all(r.alive() for r in routers), f"alive: {[r.alive() for r in routers]}")
    v.check(f"routers use Redis again within {RECOVERY_BOUND_S:g} s", recovered is not None
            and recovered <= RECOVERY_BOUND_S, f"measured {recovered}")
    await asyncio.to_thread(fleet.wait_idle, 30)
    reserved = [metric(fleet.router_metrics(r), "kvfleet_router_ratelimit_reserved_tokens") for r in routers]
    v.figures["tokens reserved at idle (per router)"] = reserved
    v.check("no reservation left at idle", all(x == 0 for x in reserved), f"{reserved}")
    # the `small` tenant's budget, by a burst through both routers at once, after the restart
    burst = 120
    t0 = time.monotonic()
    async with client(burst) as c:
        body = chat_body("Count from one to ten please.", 16, False)
        results = await asyncio.gather(*(request(c, fleet.routers[k % 2].url, body, KEYS["small"], timeout=120)
                                         for k in range(burst)))
    elapsed = time.monotonic() - t0
    ok = [r for r in results if r.ok]
    refused = sum(r.status == 429 for r in results)
    reservation = (ok[0].usage["prompt_tokens"] + 16) if ok else 0
    refill = SMALL_BUDGET * elapsed / 60
    reserved = len(ok) * reservation
    v.figures["small tenant: budget / burst / admitted / refused"] = (SMALL_BUDGET, burst, len(ok), refused)
    v.figures["small tenant: tokens reserved by the admitted / refill while the burst ran"] = (reserved, round(refill))
    v.check("budget enforced once across both routers", refused > 0 and len(ok) + refused == burst
            and SMALL_BUDGET - reservation <= reserved <= SMALL_BUDGET + refill + reservation,
            f"{len(ok)} admitted x {reservation} tokens reserved = {reserved}, {refused} refused; budget "
            f"{SMALL_BUDGET} (+ at most {refill:.0f} refilled); one router's own budget would admit about twice")
    closed.stop()
    fleet.extra.remove(closed)
    return v

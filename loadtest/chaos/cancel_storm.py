"""Cancellation storm: streaming requests, a random half dropped by the client at a random point (before the
response headers, during prefill, during decode), through the routers and straight at the engines.

Pass: every engine returns to idle with no block held; every request not dropped completes (a [DONE]-ended
stream with a finish reason and the usage it announced); zero 5xx.
"""

from __future__ import annotations

import asyncio
import random
import time

from loadtest.chaos.clients import CUT_POINTS, Tally, chat_body, prompt, request
from loadtest.chaos.common import Options, check_no_leak, client
from loadtest.chaos.fleet import KEYS, Fleet
from loadtest.chaos.verdict import Verdict

NAME = "cancellation storm"


async def run(fleet: Fleet, opts: Options) -> Verdict:
    v = Verdict(NAME)
    n = opts.scale(2000, 200)
    concurrency = 48
    rng = random.Random(opts.seed + 1)
    targets = [(r.url, KEYS["alpha"], {}) for r in fleet.routers]
    targets += [(e.url, None, fleet.auth) for e in fleet.engines]
    plans = []
    for i in range(n):
        url, key, headers = targets[i % len(targets)]
        cut = rng.choice(CUT_POINTS) if rng.random() < 0.5 else None
        long = cut == "mid_prefill" or rng.random() < 0.2
        body = chat_body(prompt(rng, rng.randint(250, 500) if long else rng.randint(10, 60)), rng.randint(4, 32),
                         True)
        plans.append((url, key, headers, cut, body, random.Random(rng.random())))
    tally = Tally()
    sem = asyncio.Semaphore(concurrency)
    t0 = time.monotonic()
    async with client(concurrency * 2) as c:
        async def one(plan):
            url, key, headers, cut, body, r = plan
            async with sem:
                res = tally.add(await request(c, url, body, key, headers, timeout=180, cut=cut, rng=r))
                res.extra_expected = body["max_tokens"]  # type: ignore[attr-defined]
        await asyncio.gather(*(one(p) for p in plans))
    v.figures["requests"] = n
    v.figures["wall time (s)"] = round(time.monotonic() - t0, 1)
    dropped = [r for r in tally.results if r.dropped]
    kept = [r for r in tally.results if not r.dropped]
    by_point = {p: sum(1 for r in dropped if r.dropped == p) for p in CUT_POINTS}
    v.figures["dropped by the client (by point)"] = by_point
    v.figures["dropped mid-decode after >=1 token"] = sum(1 for r in dropped if r.dropped == "mid_decode" and r.chunks)
    v.figures["dropped mid-prefill before any token"] = sum(1 for r in dropped if r.dropped == "mid_prefill"
                                                            and not r.chunks)
    v.figures["statuses"] = tally.statuses()
    bad = []
    for r in kept:
        usage = r.usage or {}
        complete = r.ok and r.finish_reason in ("stop", "length") and r.text \
            and usage.get("completion_tokens", 0) >= 1 \
            and (r.finish_reason == "stop" or usage.get("completion_tokens") == r.extra_expected)  # type: ignore
        if not complete:
            bad.append(r)
    v.figures["kept requests completed correctly"] = f"{len(kept) - len(bad)}/{len(kept)}"
    v.figures["kept p50 / p99 latency (s)"] = (tally.latency(0.5), tally.latency(0.99))
    v.check("the rest complete correctly", not bad,
            f"{len(bad)} of {len(kept)} not dropped failed" + (f", e.g. {bad[0].status} {bad[0].error} "
                                                              f"finish={bad[0].finish_reason}" if bad else ""))
    v.check("zero 5xx", tally.server_errors == 0, f"{tally.server_errors} responses with a 5xx status")
    v.check("no hung request", tally.hung == 0, f"{tally.hung} requests without an answer in 180 s")
    await check_no_leak(fleet, v)
    return v

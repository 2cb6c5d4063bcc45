"""Router death and HA: two routers, clients that fail over between them; one router is SIGKILLed under load
and started again. Both routers keep an exact view of every engine's cache from the engines' KV events, so
multi-turn traffic alternating between them hits the cache as well as traffic through one router.

Pass: every request succeeds (on the other router when its first one is dead); the restarted router's index
equals every engine's prefix cache; the alternating hit rate is within 5% (relative) of the one-router rate.
"""

from __future__ import annotations

import asyncio
import random
import time

from kvfleet.workload import generate_trace
from loadtest.chaos.clients import failover
from loadtest.chaos.common import Options, check_exact_views, client
from loadtest.chaos.fleet import KEYS, MODEL, Fleet
from loadtest.chaos.load import Load
from loadtest.chaos.verdict import Verdict

NAME = "router death and HA"
HIT_RATE_TOLERANCE = 0.05


async def _multi_turn(fleet: Fleet, seed: int, sessions: int, alternate: bool, salt: str) -> tuple[float, int]:
    """Sessions of 4 turns, 4 sessions at a time, each turn after the previous one's answer; through router-0
    only, or alternating between the routers request by request. The engines' prefix hit rate over the run.

    Every run sends the same conversations (same seed, so the same lengths and the same reuse) with `salt`
    put in front of each first message, so no run hits what an earlier one cached: the runs differ in routing
    only. (Runs of different seeds differ by several percent in hit rate on their own.)"""
    trace = generate_trace(sessions * 4, seed=seed, mode="multi_turn", min_output_tokens=8, max_output_tokens=16,
                           mean_prompt_tokens=40, turns_per_session=4)
    by_session: dict[str, list] = {}
    for req in trace:
        by_session.setdefault(req.session_id, []).append(req)
    before = [fleet.kv_state(i) for i in range(len(fleet.engines))]
    urls = [r.url for r in fleet.routers]
    counter = {"n": 0}
    failures = 0
    sem = asyncio.Semaphore(4)
    async with client(16) as c:
        async def session(reqs):
            nonlocal failures
            async with sem:
                for req in reqs:
                    k = counter["n"]
                    counter["n"] += 1
                    start = k % 2 if alternate else 0
                    body = req.body(MODEL, temperature=0)
                    body["messages"][0]["content"] = f"{salt} {body['messages'][0]['content']}"
                    res = await failover(c, urls, start, body, KEYS["alpha"], tries=2)
                    failures += not res.ok
        await asyncio.gather(*(session(s) for s in by_session.values()))
    after = [fleet.kv_state(i) for i in range(len(fleet.engines))]
    hits = sum(a["hits"] - b["hits"] for a, b in zip(after, before, strict=True))
    queries = sum(a["queries"] - b["queries"] for a, b in zip(after, before, strict=True))
    return (hits / queries if queries else 0.0), failures


async def run(fleet: Fleet, opts: Options) -> Verdict:
    v = Verdict(NAME)
    # 1. kill one router under load; clients fail over
    load = await Load([r.url for r in fleet.routers], workers=6, seed=opts.seed + 3, failover_tries=4).start()
    await asyncio.sleep(3)
    victim = fleet.routers[1]
    victim.kill()
    t_kill = time.monotonic()
    await asyncio.sleep(opts.scale(10, 5))
    victim.popen = None
    victim.start()
    restart_s = await asyncio.to_thread(victim.wait_ready)
    await asyncio.sleep(3)
    tally = await load.stop()
    v.figures["requests during the kill"] = tally.n
    v.figures["statuses"] = tally.statuses()
    v.figures["requests that failed over to the other router"] = tally.count(lambda r: r.attempts > 1)
    v.figures["of which answers cut mid-way and sent again"] = tally.count(lambda r: r.resent_after_cut > 0)
    v.figures["killed router back ready after (s)"] = round(restart_s, 1)
    v.check("clients retry on the other router: every request succeeds", tally.ok == tally.n,
            f"{tally.n - tally.ok} of {tally.n} failed" + (
                f", e.g. {next(r for r in tally.results if not r.ok).error}" if tally.ok < tally.n else ""))
    v.notes.append(f"router-1 SIGKILLed {time.monotonic() - t_kill:.0f} s before the end of this phase")
    await asyncio.to_thread(fleet.wait_idle, 30)
    await check_exact_views(fleet, v)
    # 2. hit rate: one router vs alternating between both, on the same conversations (salted per run), in
    # the order one, alternating, alternating, one (--quick: one, alternating), so drift weighs on both alike
    sessions = opts.scale(24, 8)
    order = [False, True] if opts.quick else [False, True, True, False]
    seed = random.Random(opts.seed).randrange(1 << 30)
    rates: dict[bool, list[float]] = {False: [], True: []}
    f1 = f2 = 0
    for k, alternate in enumerate(order):
        rate, failed = await _multi_turn(fleet, seed, sessions, alternate, salt=f"run{k}")
        rates[alternate].append(rate)
        f1, f2 = (f1, f2 + failed) if alternate else (f1 + failed, f2)
    one, alt = (sum(rates[False]) / len(rates[False]), sum(rates[True]) / len(rates[True]))
    v.figures["multi-turn prefix hit rate, one router (each run)"] = [round(x, 4) for x in rates[False]]
    v.figures["multi-turn prefix hit rate, alternating routers (each run)"] = [round(x, 4) for x in rates[True]]
    v.figures["multi-turn prefix hit rate, one router"] = round(one, 4)
    v.figures["multi-turn prefix hit rate, alternating routers"] = round(alt, 4)
    v.figures["multi-turn sessions x turns per run"] = f"{sessions} x 4"
    v.check("multi-turn requests succeed", f1 + f2 == 0, f"{f1 + f2} failed")
    v.check(f"alternating hit rate within {HIT_RATE_TOLERANCE:.0%} of one router's",
            one > 0 and abs(alt - one) <= HIT_RATE_TOLERANCE * one, f"{alt:.4f} vs {one:.4f}")
    await asyncio.to_thread(fleet.wait_idle, 30)
    await check_exact_views(fleet, v)
    return v

"""Soak: the whole fleet (2 engines, 2 routers, Redis) under a steady mixed workload (multi-turn sessions, single
prompts, streamed and not, 10% dropped by the client mid-stream) for --soak-minutes; the RSS of every process
and each engine's free-block count sampled every 10 s.

Trend test: for each process, a least-squares line through the second half of its RSS samples (the first
half is warm-up); its rise over that half must stay under max(16 MiB, 2% of the process's mean RSS).
Pass: no such trend, no block held at idle at the end, zero 5xx, no hung request.
"""

from __future__ import annotations

import asyncio
import random
import time

from kvfleet.workload import generate_trace
from loadtest.chaos.clients import Tally, chat_body, failover, prompt, request
from loadtest.chaos.common import Options, check_no_leak, client
from loadtest.chaos.fleet import KEYS, MODEL, Fleet, rss_bytes
from loadtest.chaos.verdict import Verdict, second_half_growth

NAME = "soak"
MIN_GROWTH = 16 << 20
REL_GROWTH = 0.02


async def _worker(fleet: Fleet, w: int, stop: asyncio.Event, tally: Tally, c) -> None:
    rng = random.Random(f"soak-{w}")
    urls = [r.url for r in fleet.routers]
    k = w
    while not stop.is_set():
        kind = rng.random()
        if kind < 0.4:  # a multi-turn session, turn after turn, alternating routers
            for req in generate_trace(4, seed=rng.randrange(1 << 30), mode="multi_turn", min_output_tokens=4,
                                      max_output_tokens=16, mean_prompt_tokens=30, turns_per_session=4):
                tally.add(await failover(c, urls, k % 2, req.body(MODEL, temperature=0), KEYS["alpha"], tries=2))
                k += 1
        elif kind < 0.9:
            body = chat_body(prompt(rng, rng.randint(5, 150)), rng.randint(4, 32), rng.random() < 0.5)
            tally.add(await failover(c, urls, k % 2, body, KEYS["beta"], tries=2))
        else:
            body = chat_body(prompt(rng, rng.randint(5, 150)), rng.randint(8, 32), True)
            await request(c, urls[k % 2], body, KEYS["alpha"], cut="mid_decode", rng=rng)
        k += 1


async def run(fleet: Fleet, opts: Options) -> Verdict:
    v = Verdict(NAME)
    minutes = min(opts.soak_minutes, 1.0) if opts.quick else opts.soak_minutes
    interval = 5.0 if opts.quick else 10.0
    procs = [*fleet.engines, *fleet.routers]
    names = [p.name for p in procs] + ["redis"]
    series: dict[str, list[float]] = {n: [] for n in names}
    free: dict[str, list[float]] = {e.name: [] for e in fleet.engines}
    ts: list[float] = []
    stop = asyncio.Event()
    tally = Tally()
    t0 = time.monotonic()
    async with client(16) as c:
        workers = [asyncio.ensure_future(_worker(fleet, w, stop, tally, c)) for w in range(4)]
        while time.monotonic() - t0 < minutes * 60:
            ts.append(time.monotonic() - t0)
            for p in procs:
                series[p.name].append(p.rss_bytes())
            series["redis"].append(rss_bytes(fleet.redis.popen.pid))
            for i, e in enumerate(fleet.engines):
                free[e.name].append((await asyncio.to_thread(fleet.kv_state, i))["free"])
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - t0 - ts[-1])))
        stop.set()
        await asyncio.gather(*workers)
    v.figures["duration (min) / samples"] = (round(minutes, 1), len(ts))
    v.figures["requests / statuses"] = (tally.n, tally.statuses())
    v.figures["p50 / p99 latency (s)"] = (round(tally.latency(0.5) or 0, 2), round(tally.latency(0.99) or 0, 2))
    trends = []
    for name in names:
        ys = series[name]
        half = ys[len(ys) // 2:]
        mean = sum(half) / max(len(half), 1)
        growth = second_half_growth(ts, ys)
        bound = max(MIN_GROWTH, REL_GROWTH * mean)
        trends.append((name, growth, bound))
        v.figures[f"RSS {name}: first / last / 2nd-half fitted rise (MB)"] = (
            round(ys[0] / 2**20, 1), round(ys[-1] / 2**20, 1), round(growth / 2**20, 2))
    for name, ys in free.items():
        v.figures[f"free blocks {name}: min / mean / last"] = (int(min(ys)), round(sum(ys) / len(ys), 1), int(ys[-1]))
    bad = [f"{n} +{g / 2**20:.1f} MB (bound {b / 2**20:.1f})" for n, g, b in trends if g > b]
    v.check("no upward RSS trend beyond noise", not bad, "; ".join(bad) or "every process under its bound")
    v.check("zero 5xx", tally.server_errors == 0, f"{tally.server_errors}")
    v.check("no hung request, no failure", tally.hung == 0 and tally.ok == tally.n,
            f"{tally.n - tally.ok} failed, {tally.hung} hung")
    await check_no_leak(fleet, v)
    v.figures["_series"] = {"t": ts, **{f"rss {k}": [round(x / 2**20, 1) for x in s] for k, s in series.items()},
                            **{f"free {k}": s for k, s in free.items()}}
    return v

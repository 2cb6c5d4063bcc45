"""KV exhaustion: requests whose KV demand totals 5x both engines' KV pools arrive within a few seconds, half
from a high-priority tenant, half from a low-priority one, through a router that sheds (--shed-kv-high 0.5
--shed-waiting-high 1 --shed-min-cost-tokens 150: the low-priority tenant's requests of >= 150 tokens, while
the engines' mean KV usage is >= 0.5 with >= 1 request waiting per engine).

Pass: no engine crashes or runs out of memory (same processes, no OOM recovery needed); engines queue and
preempt instead; every request is answered 200, or, only for the low-priority tenant, 503 shed with the
shedding error; no block leaks. p50/p99 latency reported.
"""

from __future__ import annotations

import asyncio
import random
import time

from loadtest.chaos.clients import Tally, chat_body, prompt, request
from loadtest.chaos.common import Options, check_no_leak, client
from loadtest.chaos.fleet import KEYS, Fleet, metric
from loadtest.chaos.verdict import Verdict

NAME = "KV exhaustion"
DEMAND = 5.0


async def run(fleet: Fleet, opts: Options) -> Verdict:
    v = Verdict(NAME)
    shed = fleet.start_extra_router("router-shed", "--shed-kv-high", "0.5", "--shed-waiting-high", "1",
                                    "--shed-min-cost-tokens", "150")
    pids = [e.pid for e in fleet.engines]
    before = [fleet.kv_state(i) for i in range(len(fleet.engines))]
    oom0 = sum(metric(fleet.engine_metrics(i), "kvfleet:oom_events_total") for i in range(len(fleet.engines)))
    pool_tokens = fleet.num_blocks * 16 * len(fleet.engines)
    rng = random.Random(opts.seed + 6)
    max_tokens = 64
    bodies, demand = [], 0
    while demand < DEMAND * pool_tokens:
        n_words = rng.randint(60, 110)
        bodies.append(chat_body(prompt(rng, n_words), max_tokens, rng.random() < 0.5))
        demand += int(n_words * 1.3) + max_tokens  # about 1.3 tokens a word, plus the chat template
    spread = 20.0  # arrivals go on while the pressure builds
    tally = Tally()
    peak = {"waiting": 0.0, "usage": 0.0}
    pressure = {"arrivals": 0, "samples": 0, "high": 0}  # samples taken while requests still arrive
    done = asyncio.Event()

    async def sample():
        while not done.is_set():
            states = [await asyncio.to_thread(fleet.kv_state, i) for i in range(len(fleet.engines))]
            for s in states:
                peak["waiting"] = max(peak["waiting"], s["waiting"])
                peak["usage"] = max(peak["usage"], s["usage"])
            if time.monotonic() - t0 < spread:
                pressure["samples"] += 1
                mean_usage = sum(s["usage"] for s in states) / len(states)
                mean_waiting = sum(s["waiting"] for s in states) / len(states)
                pressure["high"] += mean_usage >= 0.5 and mean_waiting >= 1
            await asyncio.sleep(0.5)

    t0 = time.monotonic()
    sampler = asyncio.ensure_future(sample())
    async with client(len(bodies) + 8, timeout=600) as c:
        async def one(k, body):
            await asyncio.sleep(spread * k / len(bodies))
            res = await request(c, shed.url, body, KEYS["alpha" if k % 2 == 0 else "beta"], timeout=600)
            res.tenant = "alpha" if k % 2 == 0 else "beta"  # type: ignore[attr-defined]
            tally.add(res)
        await asyncio.gather(*(one(k, b) for k, b in enumerate(bodies)))
    wall = time.monotonic() - t0
    done.set()
    await sampler
    after = [fleet.kv_state(i) for i in range(len(fleet.engines))]
    oom = sum(metric(fleet.engine_metrics(i), "kvfleet:oom_events_total") for i in range(len(fleet.engines))) - oom0
    shed_ok = [r for r in tally.results if r.status == 503 and "shed" in (r.error or "")]
    wrong = [r for r in tally.results if not r.ok and r not in shed_ok]
    v.figures["requests / KV demand vs pool (tokens)"] = (tally.n, f"{demand:,} vs {pool_tokens:,} "
                                                          f"({demand / pool_tokens:.1f}x)")
    v.figures["statuses"] = tally.statuses()
    v.figures["shed (503) by tenant: high / low priority"] = (
        sum(r.tenant == "alpha" for r in shed_ok), sum(r.tenant == "beta" for r in shed_ok))  # type: ignore
    v.figures["samples above the shedding thresholds while requests arrived"] = (
        f"{pressure['high']}/{pressure['samples']}")
    v.figures["preemptions"] = int(sum(a["preemptions"] - b["preemptions"]
                                       for a, b in zip(after, before, strict=True)))
    v.figures["peak waiting requests on an engine / peak KV usage"] = (int(peak["waiting"]), round(peak["usage"], 3))
    v.figures["answered p50 / p99 latency (s)"] = (round(tally.latency(0.5) or 0, 2), round(tally.latency(0.99) or 0, 2))
    v.figures["wall time (s)"] = round(wall, 1)
    v.check("no engine crashed or ran out of memory", [e.pid for e in fleet.engines] == pids
            and all(e.alive() for e in fleet.engines) and oom == 0, f"alive {[e.alive() for e in fleet.engines]}, "
            f"OOM recoveries {oom:.0f}")
    v.check("engines queue and preempt", peak["waiting"] > 0, f"peak waiting {peak['waiting']:.0f}")
    v.check("the router sheds, only the low-priority tenant", shed_ok and all(r.tenant == "beta"  # type: ignore
                                                                          for r in shed_ok),
            f"{len(shed_ok)} shed; the fleet was above the thresholds in {pressure['high']} of "
            f"{pressure['samples']} samples while requests arrived")
    v.check("everything else is answered", not wrong,
            f"{len(wrong)} other failures" + (f", e.g. {wrong[0].status} {wrong[0].error}" if wrong else ""))
    await check_no_leak(fleet, v)
    shed.stop()
    fleet.extra.remove(shed)
    return v

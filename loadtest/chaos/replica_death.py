"""Replica death: SIGKILL an engine under load and start it again, five times.

Pass: no client hangs; every request completes: one not started is retried elsewhere, a stream cut by the death
goes on on the other replica (router/http/migrate.py; failures would be clear errors: an OpenAI error body, or
an SSE error event that ends a stream); both routers see the death and the return within the bounds below; no
block leaks. Figures: the streams cut by a kill (running on the killed replica then) and the pause their clients
saw at the break (the longest gap between two of their chunks), p50 / p99.
"""

from __future__ import annotations

import asyncio
import time

from loadtest.chaos.clients import percentile
from loadtest.chaos.common import Options, check_exact_views, check_no_leak
from loadtest.chaos.fleet import Fleet, metric
from loadtest.chaos.load import Load
from loadtest.chaos.verdict import Verdict

NAME = "replica death"
DOWN_BOUND_S = 2.0  # router health checks every 0.5 s; a refused connection also marks the replica at once
UP_BOUND_S = 5.0  # from the engine's /ready until both routers route to it with its KV event stream live


async def _until(pred, timeout: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if await asyncio.to_thread(pred):
            return time.monotonic() - t0
        await asyncio.sleep(0.05)
    return None


def _routes_to(view: dict) -> bool:
    return view["ready"] == 1 and view["live"] == 1


async def run(fleet: Fleet, opts: Options) -> Verdict:
    v = Verdict(NAME)
    cycles = opts.scale(5, 2)
    retries0 = sum(metric(fleet.router_metrics(r), "kvfleet_router_retries_total") for r in fleet.routers)
    moved0 = sum(metric(fleet.router_metrics(r), "kvfleet_router_migrations_total", outcome="completed")
                 for r in fleet.routers)
    kills: list[tuple[str, float]] = []
    load = await Load([r.url for r in fleet.routers], workers=6, seed=opts.seed + 2).start()
    await asyncio.sleep(3)
    downs, ups, restarts = [], [], []
    for k in range(cycles):
        i = k % len(fleet.engines)
        e = fleet.engines[i]
        e.kill()  # SIGKILL, the whole process group
        t_kill = time.monotonic()
        kills.append((e.url, time.perf_counter()))
        down = await _until(lambda u=e.url: all(fleet.router_view(r)[u]["ready"] == 0 for r in fleet.routers), 30)
        downs.append(None if down is None else round(down, 2))
        await asyncio.sleep(2)  # traffic meanwhile goes to the survivor
        restarts.append(round(await asyncio.to_thread(fleet.restart_engine, i), 1))
        up = await _until(lambda u=e.url: all(_routes_to(fleet.router_view(r)[u]) for r in fleet.routers), 60)
        ups.append(None if up is None else round(up, 2))
        v.notes.append(f"cycle {k + 1}: killed engine-{i} at +{t_kill:.0f}")
        await asyncio.sleep(3)
    tally = await load.stop()
    retries = sum(metric(fleet.router_metrics(r), "kvfleet_router_retries_total") for r in fleet.routers) - retries0
    moved = sum(metric(fleet.router_metrics(r), "kvfleet_router_migrations_total", outcome="completed")
                for r in fleet.routers) - moved0
    cut = [r for r in tally.results if r.stream and any(
        r.replica == url and r.started < t < r.started + r.latency for url, t in kills)]
    gaps = [r.max_gap for r in cut if r.ok]
    uncut = [r.max_gap for r in tally.results if r.stream and r.ok and r not in cut and r.chunks > 1]
    v.notes.clear()
    failed = [r for r in tally.results if not r.ok]
    unclear = [r for r in failed if not r.error or r.status is None]
    not_started = [r for r in failed if r.chunks == 0]
    v.figures["cycles (SIGKILL + restart)"] = cycles
    v.figures["requests"] = tally.n
    v.figures["statuses"] = tally.statuses()
    v.figures["failed"] = len(failed)
    v.figures["router retries on another replica"] = int(retries)
    v.figures["streams cut by a kill (completed / all)"] = f"{sum(r.ok for r in cut)} / {len(cut)}"
    v.figures["streams moved to the other replica (routers' count)"] = int(moved)
    v.figures["pause at the break, p50 / p99 (s)"] = (
        f"{percentile(gaps, 0.5):.2f} / {percentile(gaps, 0.99):.2f}" if gaps else "-")
    v.figures["longest pause of the streams not cut, p50 / p99 (s)"] = (
        f"{percentile(uncut, 0.5):.2f} / {percentile(uncut, 0.99):.2f}" if uncut else "-")
    v.figures["routers see the death after (s)"] = downs
    v.figures["engine restart to ready (s)"] = restarts
    v.figures["routers route to it again after (s)"] = ups
    v.check("no hung client", tally.hung == 0, f"{tally.hung} requests unanswered in 120 s")
    v.check("every failure is a clear error", not unclear,
            f"{len(unclear)} failures without an error body/event" + (f", e.g. {unclear[0].status} "
                                                                      f"{unclear[0].error}" if unclear else ""))
    v.check("streams cut by a death go on elsewhere and complete", not failed,
            f"{len(failed)} requests failed" + (f", e.g. {failed[0].status} {failed[0].error}" if failed else ""))
    v.check("requests not started are retried and succeed", not not_started,
            f"{len(not_started)} requests failed before their first token" +
            (f", e.g. {not_started[0].status} {not_started[0].error}" if not_started else ""))
    v.check(f"routers see a death within {DOWN_BOUND_S:g} s", all(d is not None and d <= DOWN_BOUND_S for d in downs),
            f"measured {downs}")
    v.check(f"routers route to a restarted replica within {UP_BOUND_S:g} s",
            all(u is not None and u <= UP_BOUND_S for u in ups), f"measured {ups}")
    await check_no_leak(fleet, v)
    await check_exact_views(fleet, v)
    return v

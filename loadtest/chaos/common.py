"""What the scenarios share: their options, the no-leak check at idle, the routers' exact view, a probe client."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import httpx

from loadtest.chaos.clients import chat_body, percentile, request
from loadtest.chaos.fleet import KEYS, Fleet
from loadtest.chaos.verdict import Verdict


@dataclass(frozen=True)
class Options:
    quick: bool = False
    soak_minutes: float = 30.0
    seed: int = 0

    def scale(self, full: int, quick: int) -> int:
        return quick if self.quick else full


def client(max_connections: int = 256, timeout: float = 120.0) -> httpx.AsyncClient:
    """An HTTP client; `timeout` bounds each read (a whole non-streamed answer)."""
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0),
                             limits=httpx.Limits(max_connections=max_connections,
                                                 max_keepalive_connections=max_connections))


async def check_no_leak(fleet: Fleet, v: Verdict, timeout: float = 60.0) -> list[dict]:
    """Every engine back to idle: nothing running or waiting, every block free (cached blocks are free and
    evictable: KV usage is what requests hold, and at idle that must be 0)."""
    states = await asyncio.to_thread(fleet.wait_idle, timeout)
    leaked = [int(s["total"] - s["free"]) for s in states]
    busy = [int(s["running"] + s["waiting"]) for s in states]
    v.figures["blocks held at idle (per engine)"] = leaked
    v.figures["prefix-cached blocks at idle (per engine)"] = [int(s["cached"]) for s in states]
    v.check("no leaked KV block", all(n == 0 for n in leaked) and all(s["usage"] == 0 for s in states),
            f"blocks held by requests at idle: {leaked}; running+waiting: {busy}")
    return states


async def check_exact_views(fleet: Fleet, v: Verdict, routers=None, timeout: float = 15.0) -> bool:
    """Each router's exact index holds, per engine, as many blocks as that engine's prefix cache (at idle)."""
    routers = routers or fleet.routers
    deadline = time.monotonic() + timeout
    while True:
        cached = [int(fleet.kv_state(i)["cached"]) for i in range(len(fleet.engines))]
        views = [[int(fleet.router_view(r)[e.url]["indexed"]) for e in fleet.engines] for r in routers]
        same = all(view == cached for view in views)
        if same or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    v.figures["engine cached blocks vs each router's index"] = f"{cached} vs {views}"
    return v.check("routers hold the exact cache view", same,
                   f"engines' prefix caches {cached}; routers' indexes {views}")


class Probe:
    """A well-behaved client sending one short request every `period` s while a scenario runs: its latency
    is what the other clients of a stressed fleet see."""

    def __init__(self, url: str, period: float = 0.5, max_tokens: int = 8):
        self.url, self.period, self.max_tokens = url, period, max_tokens
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._task: asyncio.Task | None = None

    async def _loop(self) -> None:
        rng = random.Random(7)
        async with client(4) as c:
            while True:
                body = chat_body("Say hello to " + rng.choice(["Ann", "Bo", "Cy", "Di"]), self.max_tokens, False)
                r = await request(c, self.url, body, KEYS["alpha"], timeout=60)
                if r.ok:
                    self.latencies.append(r.latency)
                else:
                    self.failures.append(f"{r.status} {r.error}")
                await asyncio.sleep(self.period)

    def start(self) -> Probe:
        self._task = asyncio.ensure_future(self._loop())
        return self

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def p(self, q: float) -> float | None:
        return percentile(self.latencies, q)

"""router/routing/kv_events.py's subscriber against a real HTTP server that refuses its stream (503, as an engine does
while it loads): it backs off up to 2 s between tries, and `wake()` (the replica turned ready) makes it try again
at once instead of at the end of the backoff."""

from __future__ import annotations

import asyncio
import time

import httpx
from aiohttp import web

from router.routing.kv_events import KVEventSubscriber
from router.routing.prefix_index import PrefixIndex


async def _refusing_server(attempts: list[float]) -> tuple[web.AppRunner, str]:
    async def events(request: web.Request) -> web.Response:
        attempts.append(time.monotonic())
        return web.Response(status=503)

    app = web.Application()
    app.router.add_get("/v1/kv/events", events)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def test_wake_ends_the_backoff_at_once():
    async def main() -> tuple[list[float], float]:
        attempts: list[float] = []
        runner, url = await _refusing_server(attempts)
        async with httpx.AsyncClient() as client:
            sub = KVEventSubscriber(url, PrefixIndex(), client, heartbeat_timeout_s=5.0)
            task = asyncio.create_task(sub.run())
            try:
                while len(attempts) < 5:  # pauses of 0.1, 0.2, 0.4, 0.8 s so far; the next is 1.6 s
                    await asyncio.sleep(0.01)
                woken = time.monotonic()
                sub.wake()
                while len(attempts) < 6:
                    await asyncio.sleep(0.01)
                return attempts, woken
            finally:
                task.cancel()
                await runner.cleanup()

    attempts, woken = asyncio.run(main())
    gaps = [b - a for a, b in zip(attempts, attempts[1:], strict=False)]
    assert gaps[:4] == sorted(gaps[:4]) and gaps[3] > 0.6  # backing off
    assert attempts[5] - woken < 0.3  # not the 1.6 s the backoff had left

"""The router's background checks (/ready, /metrics scrapes, KV events) carry the internal token, so they
work against an engine started with --require-internal-token (the real engine app, served by uvicorn)."""

from __future__ import annotations

import asyncio

import uvicorn

from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.routing.fleet import Fleet
from router.states import KVEventsState
from tests.engine.server.test_internal_token import TOKEN, guarded_app
from tests.router.conftest import free_port


async def _fleet_against_guarded_engine(token: str | None) -> tuple[bool, bool, KVEventsState]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cfg = RouterConfig(replicas=(url,), policy="kv", internal_token=token, health_interval_s=0.05,
                       scrape_interval_s=0.05, scrape_stale_s=1.0)
    fleet = Fleet(cfg, RouterMetrics(cfg.policy))
    server = uvicorn.Server(uvicorn.Config(guarded_app(), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        await fleet.start()
        await fleet.set_replicas([url])
        st = fleet.replicas[url]
        for _ in range(200):
            if st.ready and st.load is not None and st.kv_events is KVEventsState.LIVE:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # a few more rounds of each check
        return st.ready, st.load is not None, st.kv_events
    finally:
        await fleet.stop()
        server.should_exit = True
        await serving


def test_checks_carry_the_internal_token():
    assert asyncio.run(_fleet_against_guarded_engine(TOKEN)) == (True, True, KVEventsState.LIVE)


def test_without_the_token_only_readiness_gets_through():
    ready, scraped, kv = asyncio.run(_fleet_against_guarded_engine(None))
    assert (ready, scraped, kv) == (True, False, KVEventsState.CONNECTING)

"""`GET /v1/models` through the router: the union of the models every ready replica serves (each replica's
own /v1/models, asked at once), first-seen entry per id."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping

import aiohttp


async def _models_of(session: aiohttp.ClientSession, url: str, headers: Mapping[str, str]) -> list:
    try:
        async with session.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=2.0),
                               headers=headers) as resp:
            if resp.status == 200:
                data = (await resp.json(content_type=None)).get("data")
                return data if isinstance(data, list) else []
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
        pass
    return []


async def fleet_models(session: aiohttp.ClientSession, urls: Iterable[str], headers: Mapping[str, str]) -> list[dict]:
    """Every model id the replicas at `urls` list, once each (the first replica's entry)."""
    models: dict[str, dict] = {}
    for listing in await asyncio.gather(*(_models_of(session, u, headers) for u in urls)):
        for m in listing:
            if isinstance(m, dict) and isinstance(m.get("id"), str):
                models.setdefault(m["id"], m)
    return list(models.values())

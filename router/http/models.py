"""`GET /v1/models` through the router: the union of the models every ready replica serves (each replica's
own /v1/models, asked at once), first-seen entry per id; then what the router lists of it (`listed_models`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping

import aiohttp

from router.pools.choice import PoolSpec


async def _models_of(session: aiohttp.ClientSession, url: str, headers: Mapping[str, str]) -> list:
    try:
        async with session.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=2.0),
                               headers=headers) as resp:
            if resp.status == 200:
                data = (await resp.json(content_type=None)).get("data")
                return data if isinstance(data, list) else []
    except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError):
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


def listed_models(listing: list[dict], served: Mapping[str, tuple[str, ...]], pools: Mapping[str, PoolSpec],
                  ready: Callable[[tuple[str, ...]], bool]) -> list[dict]:
    """What the router lists: the replicas' entries for the models the pools serve and for LoRA adapters of those
    models (listed with a parent); a declared model no replica lists, while one of its pools has a ready replica
    (a third-party engine listing under another name); and each pool's on-demand adapters not loaded yet, with
    the pool's model as parent. served: model -> its pools (the catalog); ready(pools): any replica ready."""
    models = [m for m in listing if m["id"] in served or m.get("parent") in served]
    on_demand = {name: spec.models[0] for spec in pools.values() if spec.models for name, _ in spec.adapters}
    ids = {m["id"] for m in models}
    for model, of in served.items():
        if model not in on_demand and model not in ids and ready(of):
            models.append({"id": model, "object": "model", "created": 0, "owned_by": "kvfleet"})
            ids.add(model)
    for name, parent in on_demand.items():
        if name not in ids:
            models.append({"id": name, "object": "model", "created": 0, "owned_by": "kvfleet", "parent": parent})
            ids.add(name)
    return models

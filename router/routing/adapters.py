"""LoRA adapters in placement: which adapter a request names, and loading one on demand.

A request names an adapter as its `model`. The router knows it is one when a replica lists it on /v1/models
with a `parent` (kvfleet and vLLM engines both do) or shows requests under it in `vllm:lora_requests_info`
(read with every scrape), or when the pool's file entry names it under `adapters:`.
Its block hashes then carry the adapter (contract/hashing.py), as the engines' do, so prefix affinity works
per adapter; and replicas without the adapter cost an adapter load in the score (policies/load.py).

Replicas that do not list the adapter are left out of a request's lease (router/http/app.py's `unfit`). With
on-demand loading (the pool's `adapters: {name: path}`, opt-in per pool), `prepare` first asks the placement
core for the best replica by that one score, holders and non-holders alike: prefix hits, load, and the adapter
load where it is missing, and a wait for a LoRA slot where every slot runs another adapter (the metric's
running adapters at its max_lora). When that is a replica without the adapter - none holds it (a cold
adapter), or its holders are busier than a load costs (a hot adapter spreads) - the router has it load the adapter through
`POST /v1/load_lora_adapter` (with the internal token) before the request is leased; concurrent requests for
the same (replica, adapter) wait for one load. A load that fails leaves the request to the replicas that hold
the adapter, if any (else the engine's 404 reaches the client).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import aiohttp

log = logging.getLogger("kvfleet.router.adapters")
LOAD_PATH = "/v1/load_lora_adapter"
LOAD_TIMEOUT_S = 60.0


def request_adapter(model: str, pool_adapters: Mapping[str, str], placement) -> str | None:
    """The LoRA adapter a request for `model` runs under (None: a base model)."""
    return model if model in pool_adapters or placement.is_adapter(model) else None


class AdapterLoader:
    def __init__(self, fleet, session_of, headers: Mapping[str, str], metrics=None):
        """fleet: router/routing/fleet.py's Fleet; session_of: () -> the aiohttp session; headers: the internal
        token's header, if any; metrics: the router's (kvfleet_router_adapter_loads_total), if any."""
        self.fleet = fleet
        self.metrics = metrics
        self.session_of = session_of
        self.headers = dict(headers)
        self._loading: dict[tuple[str, str], asyncio.Future] = {}
        self.loads = 0  # adapters loaded on a replica by this router
        self.failures = 0

    async def prepare(self, prep, model: str, pool: str, pool_adapters: Mapping[str, str],
                      excluded: frozenset[str] = frozenset()) -> None:
        """Mark the request's adapter on `prep` (before anything hashes it); with on-demand loading for this
        adapter in this pool, load it where the score says it should run, if that replica lacks it."""
        placement = self.fleet.placement
        prep.adapter = request_adapter(model, pool_adapters, placement)
        path = pool_adapters.get(model)
        if path is None:
            return
        decision = placement.choose(prep, self.fleet.clock(), pool, excluded, peek=True)
        if decision is None or placement.replicas[decision.url].holds(model):
            return
        await self.load(decision.url, model, path, pool)

    async def load(self, url: str, name: str, path: str, pool: str = "-") -> bool:
        key = (url, name)
        pending = self._loading.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        fut = self._loading[key] = asyncio.get_running_loop().create_future()
        try:
            ok = await self._post(url, name, path)
            if self.metrics is not None:  # once per load, not per request waiting for it
                self.metrics.adapter_loads.labels(pool, "loaded" if ok else "failed").inc()
            fut.set_result(ok)
            return ok
        finally:
            self._loading.pop(key, None)
            if not fut.done():
                fut.set_result(False)

    async def _post(self, url: str, name: str, path: str) -> bool:
        try:
            async with self.session_of().post(url + LOAD_PATH, json={"lora_name": name, "lora_path": path},
                                              headers=self.headers,
                                              timeout=aiohttp.ClientTimeout(total=LOAD_TIMEOUT_S)) as resp:
                text = await resp.text()
                ok = resp.status == 200 or (resp.status == 400 and "already been loaded" in text)
        except (TimeoutError, aiohttp.ClientError) as e:
            ok, text = False, f"{type(e).__name__}: {e}"
        if ok:
            self.loads += 1
            self.fleet.placement.on_adapter_loaded(url, name)
            log.info("loaded LoRA adapter %s on %s (%s)", name, url, path)
        else:
            self.failures += 1
            log.warning("loading LoRA adapter %s on %s failed: %s", name, url, text[:300])
        return ok

"""The fleet's own view of a run, from vLLM-style `/metrics`: prefix-cache hit rate and KV usage over time.

A kvfleet router's /metrics names its replicas (`kvfleet_router_replica_ready{replica="URL"}`); the scraper
then reads each engine's /metrics. An engine (kvfleet, vLLM) is read directly. Targets without /metrics are
skipped quietly: the run's figures do not depend on them.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from itertools import pairwise

import httpx

from router.routing.replicas import parse_engine_metrics

_REPLICA = re.compile(r'^kvfleet_router_replica_ready\{[^}]*replica="([^"]+)"', re.M)


@dataclass(frozen=True)
class Sample:
    t_s: float  # seconds after the run started
    kv_usage: float  # mean over the engines, 0..1
    running: int
    waiting: int
    prefix_queries: float  # summed over the engines (counters)
    prefix_hits: float


def router_replicas(metrics_text: str) -> list[str]:
    return list(dict.fromkeys(_REPLICA.findall(metrics_text)))


def engine_metric_urls(target: str, client: httpx.Client | None = None) -> list[str]:
    """The engines whose /metrics describe `target`: its replicas when it is a kvfleet router, else itself;
    [] when it exports no vLLM-style metrics."""
    get = (client or httpx).get
    try:
        text = get(target.rstrip("/") + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return []
    replicas = router_replicas(text)
    if replicas:
        return replicas
    return [target.rstrip("/")] if parse_engine_metrics(text).engine != "unknown" else []


def sample_from(texts: list[str], t_s: float) -> Sample:
    loads = [parse_engine_metrics(t) for t in texts]
    return Sample(t_s, sum(x.kv_usage for x in loads) / max(len(loads), 1), sum(x.running for x in loads),
                  sum(x.waiting for x in loads), sum(x.prefix_queries for x in loads),
                  sum(x.prefix_hits for x in loads))


def summarize_samples(samples: list[Sample]) -> dict | None:
    """Hit rate over the run (counter deltas, first to last sample), KV usage mean and peak, and the series
    (hit rate per interval) for the plots."""
    if len(samples) < 2:
        return None
    first, last = samples[0], samples[-1]
    dq = last.prefix_queries - first.prefix_queries
    series = []
    for a, b in pairwise(samples):
        q = b.prefix_queries - a.prefix_queries
        series.append({"t_s": b.t_s, "kv_usage": b.kv_usage, "running": b.running, "waiting": b.waiting,
                       "hit_rate": (b.prefix_hits - a.prefix_hits) / q if q > 0 else None})
    return {"prefix_hit_rate": (last.prefix_hits - first.prefix_hits) / dq if dq > 0 else None,
            "prefix_queries": dq, "kv_usage_mean": sum(s.kv_usage for s in samples) / len(samples),
            "kv_usage_max": max(s.kv_usage for s in samples), "series": series}


class Scraper:
    """Samples the engines every `interval_s` while a run is in flight (`async with`), once more at the end."""

    def __init__(self, urls: list[str], interval_s: float = 1.0):
        self.urls, self.interval_s = urls, interval_s
        self.samples: list[Sample] = []
        self._task: asyncio.Task | None = None
        self._t0 = 0.0
        self._client: httpx.AsyncClient | None = None

    async def _sample(self) -> None:
        try:
            texts = [(await self._client.get(u + "/metrics", timeout=5)).text for u in self.urls]
        except httpx.HTTPError:
            return
        self.samples.append(sample_from(texts, time.perf_counter() - self._t0))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self._sample()

    async def __aenter__(self) -> Scraper:
        self._t0 = time.perf_counter()
        if self.urls:
            self._client = httpx.AsyncClient()
            await self._sample()
            self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            await asyncio.sleep(0.2)  # the engines count a request's blocks as it ends
            await self._sample()
            await self._client.aclose()

    def summary(self) -> dict | None:
        return summarize_samples(self.samples)

"""Prefill/decode disaggregation on the KV transfer (issue 31).

A request whose pool has `role: decode` is first sent, as a one-token, non-streamed request, to a replica of a
`role: prefill` pool of its model (the placement core chooses it, prefix affinity included): that replica computes
the prompt and keeps its blocks cached. Then the request itself goes to a replica of the decode pool with the
prefill replica as the source to pull from (router/http/proxy.py sends `x-kvfleet-kv-pull`); the decode engine pulls
the prompt's KV (engine/server/kv_transfer.py) and streams the answer. TTFT counts from the client's request, as
always. Whatever fails on the prefill side (no replica, an error, a timeout) leaves the request colocated: the
decode replica computes the prompt itself.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import aiohttp

from contract.request import OpenAIRequest
from router.routing.lease import Lease
from router.routing.prepare import PreparedRequest

log = logging.getLogger("kvfleet.router.disagg")

PREFILL_TIMEOUT_S = 120.0


def prefill_body(req: OpenAIRequest) -> bytes:
    """The request as its prefill: one token, not streamed, one choice."""
    one = req.with_max_tokens(1).with_fields(stream=False, n=1)
    if req.get("stream_options") is not None:
        one = one.with_fields(stream_options=None)
    if req.get("min_tokens") is not None:
        one = one.with_fields(min_tokens=None)
    return one.upstream_body()


async def prefill(session: aiohttp.ClientSession, fleet, metrics, path: str, req: OpenAIRequest,
                  prep: PreparedRequest, pool: str, headers: list[tuple[str, str]]) -> str | None:
    """Prefill the request on a replica of `pool`; that replica's URL, or None when it could not (counted by
    outcome: ok, no_replica, failed, refused)."""
    ls = fleet.lease(prep, set(), pool)
    if ls is None:
        metrics.disagg.labels(pool, "no_replica").inc()
        return None
    t0 = time.perf_counter()
    try:
        async with session.post(ls.url + path, data=prefill_body(req), headers=headers,
                                timeout=aiohttp.ClientTimeout(total=PREFILL_TIMEOUT_S)) as resp:
            await resp.read()
            status = resp.status
    except (TimeoutError, aiohttp.ClientError, ConnectionError) as e:
        ls.failed()
        ls.release()
        log.warning("prefill on %s failed: %s", ls.url, e)
        metrics.disagg.labels(pool, "failed").inc()
        return None
    if status == 200:
        ls.succeeded()
    elif status in (429, 503):
        ls.refused()
    elif status >= 500:
        ls.failed()
    else:
        ls.succeeded()  # the request's own fault: the decode replica answers it the same way
    ls.release()
    if status != 200:
        metrics.disagg.labels(pool, "refused" if status < 500 else "failed").inc()
        return None
    metrics.disagg.labels(pool, "ok").inc()
    metrics.disagg_prefill_seconds.labels(pool).observe(time.perf_counter() - t0)
    return ls.url


def pull_from(ls: Lease | None, source: str | None, prompt_tokens: int) -> Lease | None:
    """The decode lease, told to pull the prompt from the prefill replica (unless it is that replica)."""
    if ls is not None and source is not None and ls.url != source:
        d = ls.decision
        ls.decision = replace(d, pull_from=source, pull_tokens=max(prompt_tokens - d.predicted_cached_tokens, 0))
    return ls

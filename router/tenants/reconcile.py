"""Reconcile: the pending ledger records of requests no router settled (its router died), closed from what their
engines say they used (router/tenants/pending.py says how; contract/usage_lookup.py is the question).

One round, every few heartbeats of every router: one pipelined Redis call reads every tenant's due records; one
lookup per replica named in them asks what those requests used; one pipelined Redis call closes them (each
once, whichever router gets there first). Nothing is due: one Redis round trip, no engine asked.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from contract.usage_lookup import MAX_IDS, PATH, UNKNOWN, parse_answer
from router.tenants import pending
from router.tenants.budget import BudgetSpec
from router.tenants.ledger import ROUTER_LOST
from router.tenants.limiter import Limiter
from router.tenants.registry import TenantRegistry

log = logging.getLogger("kvfleet.router.reconcile")
LOOKUP_TIMEOUT_S = 5.0
MIN_GRACE_S = 60.0  # a due record whose engine runs it still, or cannot be asked, waits at least this long more
RECONCILE_EVERY_BEATS = 5  # a round every ~10 s at the default 2 s heartbeat


@dataclass(frozen=True)
class Round:
    settled: int = 0  # closed with the engine's usage (router_lost_settled)
    lost: int = 0  # closed as reserved (router_lost): the engine did not know the request
    waiting: int = 0  # left pending: its engine runs it still or did not answer


async def lookup(session: aiohttp.ClientSession, replica: str, ids: list[str], token: str | None,
                 timeout_s: float = LOOKUP_TIMEOUT_S) -> dict[str, dict | str] | None:
    """What `replica` says of these requests; None where it could not be asked (down, failing: try again later).
    An engine without the lookup (404: vLLM, SGLang) knows none of them."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    out: dict[str, dict | str] = {}
    try:
        for i in range(0, len(ids), MAX_IDS):
            async with session.post(replica + PATH, json={"request_ids": ids[i:i + MAX_IDS]}, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                if r.status in (404, 405):
                    return dict.fromkeys(ids, UNKNOWN)
                if r.status != 200:
                    log.warning("usage lookup on %s: HTTP %d", replica, r.status)
                    return None
                out.update(parse_answer(await r.json(content_type=None)))
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        log.warning("usage lookup on %s failed: %r", replica, e)
        return None
    return out


async def reconcile(limiter: Limiter, registry: TenantRegistry, token: str | None, grace_s: float,
                    clock: Callable[[], float] = time.time) -> Round:
    """One round over every tenant of the registry (the shared store only: else nothing is pending)."""
    specs = {name: BudgetSpec(t.tokens_per_minute, t.max_concurrent_requests) for name, t in registry.tenants.items()}
    due = await limiter.due(list(specs))
    if not any(due.values()):
        return Round()
    asked: dict[str, list[str]] = defaultdict(list)
    for rows in due.values():
        for p in rows:
            if p.replica is not None:
                asked[p.replica].append(p.request_id)
    answers: dict[str, dict | str | None] = {}
    async with aiohttp.ClientSession() as session:
        replies = await asyncio.gather(*(lookup(session, r, ids, token) for r, ids in asked.items()))
    for ids, reply in zip(asked.values(), replies, strict=True):
        for rid in ids:
            answers[rid] = None if reply is None else reply.get(rid, UNKNOWN)
    closes: dict[str, list[pending.Close]] = {}
    settled = lost = waiting = 0
    now = clock()
    for tenant, rows in due.items():
        for p in rows:
            model = p.record.model
            prices, t = registry.prices(tenant, model), registry.tenants.get(tenant)
            cost_budget = t is not None and t.cost_budget and prices is not None
            c = pending.close(p, answers.get(p.request_id), registry.token_weight(model), prices, now, grace_s,
                              cost_budget)
            if c is None:
                waiting += 1
                continue
            closes.setdefault(tenant, []).append(c)
            if c.outcome == ROUTER_LOST:
                lost += 1
            else:
                settled += 1
    done = await limiter.close_pending({t: specs[t] for t in closes}, closes)
    if done < settled + lost:  # another router closed some of them first: count only ours
        settled, lost = min(settled, done), done - min(settled, done)
    return Round(settled, lost, waiting)


def reconcile_every_beats(heartbeat_s: float, reconcile_after_s: float) -> int:
    """Heartbeats between reconcile rounds: RECONCILE_EVERY_BEATS, or fewer when records fall due sooner (a record
    due 1 s after admission is looked at within a heartbeat of that, not up to 10 s later)."""
    return max(1, min(RECONCILE_EVERY_BEATS, math.ceil(reconcile_after_s / heartbeat_s)))


def grace_for(reconcile_after_s: float) -> float:
    return max(MIN_GRACE_S, reconcile_after_s)

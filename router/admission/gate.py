"""The gate in front of full pools (`--replica-slots N`): a request goes straight through while its pool has
room; otherwise it waits in the pool's fair queue (router/admission/fair_queue.py, the Virtual Token Counter
across tenants) until room frees, and is dispatched in the queue's order.

Room: each routable replica of the pool takes `slots` requests (the engines' --max-num-seqs: beyond it they
queue first come, first served); its occupancy is what its last scrape counted running and waiting, plus this
router's requests sent since and minus those finished since, at least this router's own in flight there; a
replica at or past the KV usage limit has none. Requests let through (straight or released from the queue) but
not yet sent count against the room too, so one free slot lets one request through, however many arrive at once.

Service is metered (the request's output charged to its tenant when it ends, which needs the usage of the
stream) while the pool is congested: from the first request it had to queue until `METER_S` after the last one;
in between, the lift of a tenant that becomes backlogged (fair_queue.py) starts everyone level, and an
uncongested pool costs nothing here but the room check.

With an express lane (`express`, the router's --forward-priority: engines that preempt by priority), a tenant
holding fewer requests in the pool than its share of the pool's seats (seats x its weight / the weights of the
tenants with requests there) goes straight on even when the pool is full, marked to run ahead
(`Pass.express`): the engine preempts a request of a tenant over its share, so a light tenant's TTFT does not
wait for a seat to free.

A queued request ends in one of three ways: dispatched (its future resolves), cancelled (the client went away:
it leaves the queue, nothing reached an engine), or refused: 429 `queue_full` at a depth limit, 503
`queue_timeout` after `timeout_s`, both with Retry-After. Every release, end of a request and tick (every
`tick_s` while anything is queued) dispatches what the room allows.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from router.admission.fair_queue import FairQueue, FairQueueConfig, Queued
from router.refusal import Refusal, refuse

TICK_S = 0.02
METER_S = 10.0


def _released(item: Queued) -> asyncio.Future[bool]:
    """The future a queued request waits on (its `key`: True when dispatched, False when timed out)."""
    return cast("asyncio.Future[bool]", item.key)


@dataclass(slots=True)
class Pass:
    """A request let through: call `sent()` once it is on its way to a replica, `done(output_tokens)` at its end."""

    gate: Gate
    pool: str
    tenant: str
    metered: bool  # the pool is congested: its output is charged when it ends (the stream must report usage)
    express: bool = False  # under its tenant's share of a full pool: sent to run ahead (engine priority)
    unsent: bool = True  # let through, not yet sent: it holds a place in the pool's room
    finished: bool = False

    def sent(self) -> None:
        if self.unsent:
            self.unsent = False
            self.gate.pending[self.pool] -= 1

    def done(self, output_tokens: int) -> None:
        if self.finished:
            return
        self.finished = True
        self.sent()
        held = self.gate.holding[self.pool]
        held[self.tenant] -= 1
        if not held[self.tenant]:
            del held[self.tenant]
        self.gate.queue(self.pool).charge(self.tenant, 0, output_tokens)
        self.gate.dispatch(self.pool)


class Gate:
    def __init__(self, cfg: FairQueueConfig, room: Callable[[str], int], metrics, clock=time.monotonic,
                 seats: Callable[[str], int] | None = None):
        """`room(pool)`: requests the pool's replicas can take now (see the module docstring); `seats(pool)`: all
        they take (given: the express lane is on)."""
        self.cfg, self.room, self.metrics, self.clock, self.seats = cfg, room, metrics, clock, seats
        self.holding: dict[str, dict[str, int]] = {}  # pool -> tenant -> its requests let through, not ended
        self.queues: dict[str, FairQueue] = {}
        self.pending: dict[str, int] = {}  # pool -> let through, not yet sent
        self.congested_at: dict[str, float] = {}  # pool -> when a request of it last had to queue
        self.priority_label: dict[str, str] = {}  # tenant -> its priority, as the queued gauge labels it
        self._ticker: asyncio.Task | None = None

    def queue(self, pool: str) -> FairQueue:
        fq = self.queues.get(pool)
        if fq is None:
            fq = self.queues[pool] = FairQueue(self.cfg)
            self.pending[pool] = 0
            self.holding[pool] = {}
        return fq

    def _pass(self, pool: str, tenant: str, metered: bool, express: bool = False,
              counted: bool = False) -> Pass:
        """A request let through; `counted`: released from the queue, already counted in `pending`."""
        if not counted:
            self.pending[pool] += 1
        held = self.holding[pool]
        held[tenant] = held.get(tenant, 0) + 1
        return Pass(self, pool, tenant, metered, express)

    def _under_share(self, pool: str, tenant: str) -> bool:
        """Whether `tenant` holds fewer of the pool's seats than its weighted share among the tenants there."""
        if self.seats is None:  # no express lane
            return False
        fq, held = self.queues[pool], self.holding[pool]
        active = set(held) | set(fq.queues) | {tenant}
        total = sum(fq.weights.get(t, 1.0) for t in active)
        return held.get(tenant, 0) < self.seats(pool) * fq.weights.get(tenant, 1.0) / total

    def _has_room(self, pool: str) -> bool:
        return self.room(pool) - self.pending[pool] > 0

    async def enter(self, pool: str, tenant: str, weight: float, priority: int, prompt_tokens: int,
                    tenant_priority: int = 0) -> Pass | Refusal:
        """Wait for room in `pool` (see the module docstring); cancelled with the request. `priority` orders the
        tenant's own queued requests; `tenant_priority` only labels the metrics."""
        fq = self.queue(pool)
        self.priority_label[tenant] = str(tenant_priority)
        if fq.weights.get(tenant) != weight:
            fq.set_weight(tenant, weight)
        if not fq.queues and self._has_room(pool):  # nobody waits, room: straight through
            fq.charge(tenant, prompt_tokens, 0)
            fq.last_dispatched = tenant
            return self._pass(pool, tenant, self.clock() - self.congested_at.get(pool, -METER_S) < METER_S)
        if self.seats is not None and not fq.queues.get(tenant) and self._under_share(pool, tenant):
            fq.charge(tenant, prompt_tokens, 0)  # the express lane: full, but this tenant is under its share
            self.congested_at[pool] = self.clock()
            return self._pass(pool, tenant, True, express=True)
        loop = asyncio.get_running_loop()
        released: asyncio.Future[bool] = loop.create_future()
        item = Queued(tenant, self.clock(), priority, prompt_tokens, released)
        self.congested_at[pool] = item.arrived
        full = fq.push(item)
        m = self.metrics
        if full is not None:
            m.queue_refused.labels(pool, f"full-{full}").inc()
            return refuse(429, f"pool {pool} is full and its queue holds as many requests "
                          f"{'of this API key' if full == 'tenant' else 'as it may'}; retry shortly", "queue_full",
                          None, "queue_full", [(b"retry-after", b"1")])
        m.queued.labels(pool, tenant, self.priority_label[tenant]).inc()
        self._start_ticker()
        self.dispatch(pool)
        try:
            await released
        except asyncio.CancelledError:
            if fq.remove(item):
                m.queued.labels(pool, tenant, self.priority_label[tenant]).dec()
                m.queue_refused.labels(pool, "cancelled").inc()
            elif released.done() and not released.cancelled() and released.result():
                self.pending[pool] -= 1  # released just now, never let through: its room goes to the next
                self.dispatch(pool)
            raise
        waited = self.clock() - item.arrived
        m.queue_seconds.labels(pool).observe(waited)
        if not released.result():
            m.queue_refused.labels(pool, "timeout").inc()
            return refuse(503, f"pool {pool} stayed full for {self.cfg.timeout_s:g} s while this request waited; "
                          "retry", "queue_timeout", None, "queue_timeout", [(b"retry-after", b"1")])
        return self._pass(pool, tenant, True, counted=True)

    def dispatch(self, pool: str) -> None:
        """Release queued requests of `pool` while it has room, in the fair queue's order."""
        fq = self.queues.get(pool)
        if fq is None:
            return
        while fq.queues and self._has_room(pool):
            item = fq.pop()
            if item is None:
                break
            self.metrics.queued.labels(pool, item.tenant, self.priority_label[item.tenant]).dec()
            released = _released(item)
            if not released.done():
                self.pending[pool] += 1
                released.set_result(True)

    def _expire(self, now: float) -> None:
        for pool, fq in self.queues.items():
            for item in fq.expired(now):
                self.metrics.queued.labels(pool, item.tenant, self.priority_label[item.tenant]).dec()
                released = _released(item)
                if not released.done():
                    released.set_result(False)

    def _start_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.create_task(self._tick())

    async def _tick(self) -> None:
        """While anything is queued: room may free without an event here (another router's requests ended, a
        scrape), and waits time out."""
        while any(fq.queues for fq in self.queues.values()):
            await asyncio.sleep(TICK_S)
            self._expire(self.clock())
            for pool in list(self.queues):
                self.dispatch(pool)

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker

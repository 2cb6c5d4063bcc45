"""The rate limiter the router calls: a budget store plus the policy for when that store fails
(`--ratelimit-on-store-error open|closed`).

- `closed`: a reservation the store cannot make raises `LimiterUnavailable` (answer 503).
- `open`: it is made in a local in-process store instead, with this router's share of the tenant's budget
  (capacity, rate and concurrency divided by the number of live routers last seen in Redis).

While failing, the shared store is tried again at most every `retry_s` seconds, by one call at a time
(the others meanwhile take the failing path without waiting on it); the first call that
succeeds returns to it (its budgets are authoritative) and drops the local budgets. A settle that fails is
dropped, never raised: the tokens stay charged and the lease expires by itself; its usage record is kept, as are
the records of requests settled locally meanwhile, and appended to the shared ledger once the store answers again
(router/tenants/ledger.py: no record is lost to a store outage). Each store error is counted
(`store_errors`, and `on_store_error` if given, for Prometheus); the change healthy -> failing and back is
logged once each. Nothing else is raised (but ValueError for a negative token count, a caller's bug).

    limiter = Limiter(RedisStore.from_url(url), OnStoreError.OPEN)
    got = await limiter.reserve(tenant, spec, amount)     # Reservation | Rejection, or LimiterUnavailable
    ...
    await limiter.settle(got, used)
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Final, Literal, TypeVar

from router.states import StrEnum
from router.tenants.budget import BudgetSpec, Quota
from router.tenants.pending import Close, Pending
from router.tenants.store import BudgetStore, InProcessStore, Rejection, Reservation, StoreError

log = logging.getLogger("kvfleet.router.limiter")
T = TypeVar("T")


class _Down(enum.Enum):
    DOWN = enum.auto()


_DOWN: Final = _Down.DOWN  # the shared store failed or is not being tried


class OnStoreError(StrEnum):
    OPEN = "open"  # fall back to local limits: the budget divided among the routers
    CLOSED = "closed"  # refuse: LimiterUnavailable (503)


class LimiterUnavailable(Exception):
    """The budget store failed and the policy is `closed`."""


class Limiter:
    def __init__(self, store: BudgetStore, on_error: OnStoreError = OnStoreError.CLOSED, routers: int = 1,
                 retry_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 on_store_error: Callable[[StoreError], None] | None = None):
        self.store, self.on_error = store, OnStoreError(on_error)
        self.routers = max(1, routers)
        self.retry_s, self.clock = retry_s, clock
        self.on_store_error = on_store_error
        self.healthy = True
        self.store_errors = 0
        self._retry_at = 0.0
        self._probing = False
        self._local: InProcessStore | None = None
        self._unsent: dict[str, list[str]] = {}  # usage records the shared store has not taken yet, by tenant

    def live_routers(self) -> int:
        """Routers sharing the budget, as last counted by `heartbeat` (or given at construction)."""
        return self.routers

    async def heartbeat(self, router_id: str, ttl_s: float) -> int:
        """Register this router in the shared store (if it keeps heartbeats) and refresh the router count;
        call it every few seconds, well within `ttl_s`. Returns the count: the last one seen while the store
        fails (a heartbeat is then one more probe, under the same `retry_s`)."""
        beat = getattr(self.store, "heartbeat", None)
        if beat is not None:
            count = await self._shared(lambda: beat(router_id, ttl_s))
            if count is not _DOWN:
                self.routers = max(1, count)
        return self.routers

    async def reserve(self, tenant: str, spec: BudgetSpec, amount: int, now: float | None = None,
                      pending: tuple[str, str] | None = None) -> Reservation | Rejection:
        got = await self._shared(lambda: self.store.reserve(tenant, spec, amount, now, pending))
        if got is not _DOWN:
            return got
        if self.on_error is OnStoreError.CLOSED:
            raise LimiterUnavailable("the rate-limit store is unavailable")
        if self._local is None:
            self._local = InProcessStore(self.store.lease_s, self.clock)
        got = await self._local.reserve(tenant, spec.share(self.routers), amount, now)
        return dataclasses.replace(got, local=True) if isinstance(got, Reservation) else got

    async def settle(self, reservation: Reservation, used: int, now: float | None = None,
                     record: str | None = None) -> Quota | None:
        """Charge the real usage and record it; None where the charge was dropped (store failing, or a local
        reservation whose local budgets were dropped when the shared store came back)."""
        if reservation.local:
            if self._local is None:  # the shared store is back: the record goes there, the charge is dropped
                if record is not None:
                    self._unsent.setdefault(reservation.tenant, []).append(record)
                await self.flush_records()
                return None
            return await self._local.settle(reservation, used, now, record)
        quota = await self._shared(lambda: self.store.settle(reservation, used, now, record))
        if quota is _DOWN:
            if record is not None:
                self._unsent.setdefault(reservation.tenant, []).append(record)
            return None
        if self._unsent:
            await self.flush_records()
        return quota

    @property
    def unsent_records(self) -> int:
        """Usage records kept for the shared ledger, not yet in it."""
        return sum(map(len, self._unsent.values()))

    async def flush_records(self) -> None:
        """Append the records kept while the shared store failed; a failure keeps them (in order) for next time."""
        while self._unsent:
            tenant = next(iter(self._unsent))
            records = self._unsent.pop(tenant)
            if await self._shared(partial(self.store.append, tenant, records)) is _DOWN:
                self._unsent.setdefault(tenant, [])[:0] = records
                return

    async def due(self, tenants: list[str]) -> dict[str, list[Pending]]:
        """The pending records past their deadline of requests no router settled (shared stores only), by tenant;
        the calls go to the store together (one pipeline)."""
        due = getattr(self.store, "due", None)
        if due is None or not self.healthy:
            return {}
        got = await asyncio.gather(*(self._shared(partial(due, t)) for t in tenants))
        return {t: rows for t, rows in zip(tenants, got, strict=True) if rows is not _DOWN and rows}

    async def close_pending(self, specs: dict[str, BudgetSpec], closes: dict[str, list[Close]]) -> int:
        """Close due pending records (router/tenants/pending.py), together; how many this router closed."""
        close = getattr(self.store, "close_pending", None)
        if close is None or not closes:
            return 0
        got = await asyncio.gather(*(self._shared(partial(close, t, specs[t], cs)) for t, cs in closes.items()))
        return sum(n for n in got if n is not _DOWN)

    async def attach(self, tenant: str, request_id: str, replica: str) -> None:
        """Name the replica a request is sent to in its pending record (shared stores only; a failure is counted,
        and the request goes on: its record would then be closed as reserved)."""
        attach = getattr(self.store, "attach", None)
        if attach is not None:
            await self._shared(partial(attach, tenant, request_id, replica))

    async def records(self, tenant: str, start: float, end: float) -> list[str]:
        """A tenant's usage records from the shared store (with those not yet sent to it); StoreError there."""
        rows = await self.store.records(tenant, start, end)
        return rows + list(self._unsent.get(tenant, ())) + (
            await self._local.records(tenant, start, end) if self._local is not None else [])

    async def _shared(self, call: Callable[[], Awaitable[T]]) -> T | Literal[_Down.DOWN]:
        """`await call()` on the shared store; `_DOWN` where it failed or, while failing, is not tried."""
        probe = not self.healthy  # while failing, one call at a time probes, every retry_s at most
        if probe:
            if self._probing or self.clock() < self._retry_at:
                return _DOWN
            self._probing = True
        try:
            result = await call()
        except StoreError as e:
            self._failed(e)
            return _DOWN
        finally:
            if probe:
                self._probing = False
        self._recovered()
        return result

    def _failed(self, e: StoreError) -> None:
        self.store_errors += 1
        self._retry_at = self.clock() + self.retry_s
        if self.on_store_error is not None:
            self.on_store_error(e)
        if self.healthy:
            self.healthy = False
            log.warning("rate-limit store failing (%s); policy %s: %s", e, self.on_error,
                        f"local limits, 1/{self.routers} of each budget" if self.on_error is OnStoreError.OPEN
                        else "requests get 503")

    def _recovered(self) -> None:
        if not self.healthy:
            self.healthy = True
            if self._local is not None:  # the records of requests settled locally go to the shared ledger
                for tenant, records in self._local.take_ledger().items():
                    self._unsent.setdefault(tenant, []).extend(records)
            self._local = None
            log.warning("rate-limit store healthy again after %d errors; shared budgets apply",
                        self.store_errors)

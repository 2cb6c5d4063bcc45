"""Where budgets live: the `BudgetStore` interface, its results, and the in-process store (one router).
router/tenants/redis_store.py is the shared store (every router replica, one budget); router/tenants/limiter.py picks
between them when Redis fails.

    got = await store.reserve(tenant, spec, prompt_tokens + n * max_tokens)
    if isinstance(got, Rejection): ...            # 400 if got.reason is TOO_LARGE, else 429 + Retry-After
    try: ... proxy ...
    finally: await store.settle(got, used, rec)   # refund reserved - used, release the lease, record the usage

A reservation's lease expires `lease_s` after admission (the request timeout) even if it is never settled,
so a router that dies leaks no concurrency slot; its reserved tokens stay charged.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from router.tenants.budget import Bucket, BudgetSpec, Denial, Leases, Quota, Reason, admit


class StoreError(Exception):
    """The store could not be reached or failed (router/tenants/limiter.py applies the store-error policy)."""


@dataclass(frozen=True)
class Reservation:
    tenant: str
    spec: BudgetSpec
    amount: int  # tokens reserved
    lease_id: str | None  # None where concurrency is unlimited
    quota: Quota  # header values right after admission
    local: bool = False  # made by router/tenants/limiter.py's fallback store, not the shared one
    pending_id: str | None = None  # the request id of its pending ledger record (shared store only)


@dataclass(frozen=True)
class Rejection:
    tenant: str
    reason: Reason
    retry_after_s: float | None  # None for Reason.TOO_LARGE
    quota: Quota


class BudgetStore(Protocol):
    lease_s: float  # a concurrency lease expires this long after admission (the request timeout)

    async def reserve(self, tenant: str, spec: BudgetSpec, amount: int, now: float | None = None,
                      pending: tuple[str, str] | None = None) -> Reservation | Rejection:
        """Admit `amount` tokens (and a concurrency lease) for `tenant`, atomically, or say why not.
        `now` (seconds) is for tests; stores read their own clock without it. `pending`: (request id, the record
        the ledger gets should the request never be settled), kept by a shared store until it is."""
        ...

    async def settle(self, reservation: Reservation, used: int, now: float | None = None,
                     record: str | None = None) -> Quota:
        """Charge the real usage: refund `amount - used` (or charge the excess) and release the lease; and, in
        the same atomic step, append `record` (router/tenants/ledger.py, as JSON) to the tenant's usage ledger."""
        ...

    async def append(self, tenant: str, records: list[str]) -> None:
        """Append records to a tenant's ledger (those a failing store could not take at settlement)."""
        ...

    async def records(self, tenant: str, start: float, end: float) -> list[str]:
        """A tenant's records settled from `start` to `end` (Unix seconds), oldest first."""
        ...

    async def state(self, tenant: str) -> tuple[Bucket | None, Leases]:
        """The tenant's stored bucket (None: never used or expired, i.e. full) and leases, expired ones
        included (for tests and inspection)."""
        ...


def new_lease_id() -> str:
    return uuid.uuid4().hex


class InProcessStore:
    """Budgets in this process's memory, through router/tenants/budget.py directly. Coroutines for the interface's
    sake; nothing awaits, so each call is atomic on the event loop."""

    def __init__(self, lease_s: float = 600.0, clock: Callable[[], float] = time.monotonic):
        self.lease_s, self.clock = lease_s, clock
        self._buckets: dict[str, Bucket] = {}
        self._leases: dict[str, Leases] = {}
        self._ledger: dict[str, list[tuple[float, str]]] = {}  # tenant -> (wall time, record), this process only

    async def reserve(self, tenant: str, spec: BudgetSpec, amount: int, now: float | None = None,
                      pending: tuple[str, str] | None = None) -> Reservation | Rejection:
        now = self.clock() if now is None else now  # `pending`: this process's memory dies with the router
        bucket = self._buckets.get(tenant) or Bucket.full(spec, now)
        lease_id = new_lease_id() if spec.max_concurrent_requests is not None else None
        got = admit(bucket, self._leases.get(tenant, Leases()), spec, amount, now, lease_id or "",
                    now + self.lease_s)
        if isinstance(got, Denial):
            return Rejection(tenant, got.reason, got.retry_after_s, bucket.refill(spec, now).quota(spec))
        self._buckets[tenant], self._leases[tenant] = got
        return Reservation(tenant, spec, amount, lease_id, got[0].quota(spec))

    async def settle(self, reservation: Reservation, used: int, now: float | None = None,
                     record: str | None = None) -> Quota:
        if record is not None:
            self._ledger.setdefault(reservation.tenant, []).append((time.time(), record))
        now = self.clock() if now is None else now
        tenant, spec = reservation.tenant, reservation.spec
        bucket = (self._buckets.get(tenant) or Bucket.full(spec, now)).settle(spec, reservation.amount, used, now)
        self._buckets[tenant] = bucket
        if reservation.lease_id is not None and tenant in self._leases:
            self._leases[tenant] = self._leases[tenant].remove(reservation.lease_id)
        return bucket.quota(spec)

    async def state(self, tenant: str) -> tuple[Bucket | None, Leases]:
        return self._buckets.get(tenant), self._leases.get(tenant, Leases())

    async def append(self, tenant: str, records: list[str]) -> None:
        t = time.time()
        self._ledger.setdefault(tenant, []).extend((t, r) for r in records)

    async def records(self, tenant: str, start: float, end: float) -> list[str]:
        return [r for t, r in self._ledger.get(tenant, ()) if start <= t < end]

    def take_ledger(self) -> dict[str, list[str]]:
        """Every record kept here, removed (to move them to the shared store once it is back)."""
        out = {tenant: [r for _, r in rows] for tenant, rows in self._ledger.items() if rows}
        self._ledger = {}
        return out

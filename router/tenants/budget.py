"""Token-budget arithmetic for one tenant: a token bucket plus a count of requests in flight. Pure: no I/O and
no clock reads (`now` is passed in, in seconds); router/tenants/store.py keeps the state in-process or in Redis,
whose Lua scripts repeat this arithmetic operation for operation (same IEEE doubles, same order), so both
give the same numbers.

The bucket of a tenant with `tokens_per_minute = T`:

- capacity `C = T` tokens: the burst is one minute's worth, so an idle tenant may spend `T` tokens at once;
- refill rate `r = T / 60` tokens per second; `refill(now)` sets `level = min(C, level + (now - updated) * r)`
  (a clock that went backwards refills nothing);
- `reserve(amount)` at admission: `amount > largest_request` (by default `C`) never fits, a distinct outcome
  (the caller answers 400, not an endless 429). Otherwise, with `need = min(amount, C)`, it is admitted when
  `level >= need` and leaves `level - amount`; else rejected with `retry_after_s = (need - level) / r`, the
  time until it fits if nothing else is spent. (`need < amount` only where `largest_request > C`: a router's
  local share of the budget while Redis is down admits a request up to the whole tenant's budget from a full
  bucket, into debt.)
- `settle(reserved, used)` at completion refills, then adds `reserved - used`: the unused part is refunded
  (never above `C`); if `used > reserved` the extra is charged and the level may drop below zero, a debt
  that delays later admissions until refill pays it back.

Over any window of `t` seconds a tenant is charged (reserved minus refunded, plus usage beyond its
reservations) at most `C + r * t` tokens plus the debt left at the window's end; a reservation alone never
takes the level below zero (outside a local share).

Concurrency: with `max_concurrent_requests = M`, each admitted request holds a lease until it settles or
its lease expires (a router that died cannot hold a slot forever); a request finding `M` live leases is
rejected with `retry_after_s = CONCURRENCY_RETRY_S`. When a request is short of both tokens and a slot, the
token rejection is reported (its retry time is known).

Per-model token weights (the tenants file's `model_token_weights`): a request for a model of weight `w` reserves
and is charged `weighted(tokens, w) = ceil(tokens * w)` budget tokens, computed exactly (w is read as the
decimal it is written as), so a 70B model's token may cost 8 of an 8B model's.

Header values (OpenAI's `x-ratelimit-*-tokens`): limit `T`, remaining `max(0, floor(level))`, reset `(C -
level) / r` seconds until the bucket is full.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from router.states import StrEnum

CONCURRENCY_RETRY_S = 1.0  # Retry-After for a request refused for concurrency: when a slot frees is unknown


class Reason(StrEnum):
    """Why a request was not admitted (metrics label)."""

    TOKENS = "tokens"  # too few tokens in the bucket now: 429 with Retry-After
    CONCURRENCY = "concurrency"  # max_concurrent_requests already in flight: 429
    TOO_LARGE = "too_large"  # larger than the whole budget, would never fit: 400


@dataclass(frozen=True)
class BudgetSpec:
    """A tenant's limits. `largest_request` (default: the capacity) is the largest reservation ever
    admitted; only a local share of a budget (`share`) sets it above the capacity."""

    tokens_per_minute: float
    max_concurrent_requests: int | None = None
    largest_request: float | None = None

    def __post_init__(self) -> None:
        if not self.tokens_per_minute > 0:
            raise ValueError(f"tokens_per_minute must be > 0, got {self.tokens_per_minute}")
        if self.max_concurrent_requests is not None and self.max_concurrent_requests < 1:
            raise ValueError(f"max_concurrent_requests must be >= 1 or None, got {self.max_concurrent_requests}")
        if self.largest_request is not None and self.largest_request < self.tokens_per_minute:
            raise ValueError(f"largest_request must be >= tokens_per_minute, got {self.largest_request}")

    @property
    def capacity(self) -> float:
        return float(self.tokens_per_minute)

    @property
    def rate(self) -> float:
        """Tokens per second."""
        return self.tokens_per_minute / 60.0

    @property
    def max_request(self) -> float:
        return self.capacity if self.largest_request is None else float(self.largest_request)

    def share(self, routers: int) -> BudgetSpec:
        """One router's part of this budget when `routers` routers enforce it without shared state: capacity,
        rate and concurrency divided (at least one slot each), requests up to the whole budget still fit."""
        n = max(1, routers)
        mcr = self.max_concurrent_requests
        return BudgetSpec(self.tokens_per_minute / n, None if mcr is None else max(1, mcr // n), self.max_request)


@dataclass(frozen=True)
class Quota:
    """Values for OpenAI's rate-limit headers."""

    limit: int  # tokens per minute
    remaining: int  # tokens available now, floor, never negative
    reset_s: float  # seconds until the bucket is full again


@dataclass(frozen=True)
class Denial:
    reason: Reason
    retry_after_s: float | None  # None for TOO_LARGE: waiting does not help


@dataclass(frozen=True)
class Bucket:
    level: float  # tokens available; negative is a debt
    updated: float  # time of the last refill, seconds

    @classmethod
    def full(cls, spec: BudgetSpec, now: float) -> Bucket:
        return cls(spec.capacity, now)

    def refill(self, spec: BudgetSpec, now: float) -> Bucket:
        if now <= self.updated:
            return self
        return Bucket(min(spec.capacity, self.level + (now - self.updated) * spec.rate), now)

    def reserve(self, spec: BudgetSpec, amount: int, now: float) -> Bucket | Denial:
        """Refill, then take `amount` tokens, or say why not (the bucket is then unchanged, not refilled)."""
        if amount < 0:
            raise ValueError(f"amount must be >= 0, got {amount}")
        if amount > spec.max_request:
            return Denial(Reason.TOO_LARGE, None)
        b = self.refill(spec, now)
        need = min(amount, spec.capacity)
        if b.level >= need:
            return Bucket(b.level - amount, b.updated)
        return Denial(Reason.TOKENS, (need - b.level) / spec.rate)

    def settle(self, spec: BudgetSpec, reserved: int, used: int, now: float) -> Bucket:
        """Refill, then refund `reserved - used` (capped at the capacity) or charge the excess (into debt)."""
        if reserved < 0 or used < 0:
            raise ValueError(f"reserved and used must be >= 0, got {reserved}, {used}")
        b = self.refill(spec, now)
        return Bucket(min(spec.capacity, b.level + (reserved - used)), b.updated)

    def quota(self, spec: BudgetSpec) -> Quota:
        """Header values for this state (refill to `now` first)."""
        reset = (spec.capacity - self.level) / spec.rate if self.level < spec.capacity else 0.0
        return Quota(int(spec.tokens_per_minute), max(0, math.floor(self.level)), reset)


@dataclass(frozen=True)
class Leases:
    """Requests in flight: (lease id, expiry) pairs. Expired leases stop counting (`live`)."""

    held: tuple[tuple[str, float], ...] = ()

    def __len__(self) -> int:
        return len(self.held)

    def live(self, now: float) -> Leases:
        return Leases(tuple(p for p in self.held if p[1] > now))

    def add(self, lease_id: str, expiry: float) -> Leases:
        return Leases(self.remove(lease_id).held + ((lease_id, expiry),))

    def remove(self, lease_id: str) -> Leases:
        return Leases(tuple(p for p in self.held if p[0] != lease_id))


def admit(bucket: Bucket, leases: Leases, spec: BudgetSpec, amount: int, now: float, lease_id: str,
          expiry: float) -> tuple[Bucket, Leases] | Denial:
    """One admission: tokens from the bucket and, where concurrency is limited, a lease `lease_id` until
    `expiry`; both or neither. Expired leases are dropped from the returned state."""
    taken = bucket.reserve(spec, amount, now)
    if isinstance(taken, Denial):
        return taken
    if spec.max_concurrent_requests is None:
        return taken, leases
    live = leases.live(now)
    if len(live) >= spec.max_concurrent_requests:
        return Denial(Reason.CONCURRENCY, CONCURRENCY_RETRY_S)
    return taken, live.add(lease_id, expiry)


def token_weight(value: float | int | str) -> Fraction:
    """A model's token weight as the exact decimal it is written as (0.1 is 1/10, not the nearest double)."""
    w = Fraction(str(value))
    if w <= 0:
        raise ValueError(f"a token weight must be > 0, got {value}")
    return w


def weighted(tokens: int, weight: Fraction) -> int:
    """Budget tokens for `tokens` tokens of a model of this weight: ceil(tokens * weight), exactly."""
    return math.ceil(tokens * weight)

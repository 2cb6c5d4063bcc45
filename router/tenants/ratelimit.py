"""The router's tenant admission edge: who is calling, what the request may cost, whether the tenant's token
budget (router/tenants/budget.py, store.py, limiter.py) lets it through,
and, once it is answered, what it really used.

Per client request, before it is routed (once, however many replicas it is retried on; the stages between
these two steps are router/admission/):
1. `identify`: the API key names the tenant (router/tenants/registry.py): none or unknown -> 401
   `invalid_api_key`;
2. `reserve`: the request's cost (router/admission/stages.py `request_cost`) from the tenant's budget: 400
   if it could never fit the budget, 429 + Retry-After (`rate_limit_exceeded`) if not now, 503 if the
   store failed under `--ratelimit-on-store-error closed`.
`settle` charges what the engine reported (its usage; the last streamed chunk's for a cancelled stream), priced
by router/tenants/pricing.py (cached prompt tokens at the model's cached price, those written to a cache_control
breakpoint at its cache-write price, where it has prices), 0 if no
replica answered with success (refused, failed, or an error answer), the whole reservation if one answered 200
without usage. Every response to
a known tenant carries OpenAI's `x-ratelimit-{limit,remaining,reset}-tokens` headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from urllib.parse import parse_qs

from contract.errors import error_body, error_type
from router.config import RateLimitConfig
from router.refusal import Refusal, refuse
from router.tenants import ledger
from router.tenants.budget import BudgetSpec, Quota, Reason
from router.tenants.file import TenantsFile
from router.tenants.ledger import RecordMeta, Ticket
from router.tenants.limiter import Limiter, LimiterUnavailable, OnStoreError
from router.tenants.pricing import Prices, charge_units, cost_usd, reserve_units, usage_of
from router.tenants.reconcile import grace_for, reconcile, reconcile_every_beats
from router.tenants.registry import AuthError, Tenant
from router.tenants.store import BudgetStore, InProcessStore, Rejection, Reservation, StoreError

log = logging.getLogger("kvfleet.router.ratelimit")


@dataclass(frozen=True, slots=True)
class Budget:
    """A tenant's admitted request: its reservation and the x-ratelimit-* headers of the response."""

    tenant: Tenant
    reservation: Reservation | None  # None: the store failed open without a budget (never: see Limiter)
    headers: list[tuple[bytes, bytes]]
    weight: Fraction = Fraction(1)  # budget tokens per token of the request's model (router/tenants/budget.py)
    prices: Prices | None = None  # the model's prices for this tenant (router/tenants/pricing.py), if any
    model: str = "-"


def reset_text(seconds: float) -> str:
    """OpenAI's reset duration format: 120ms, 1.5s, 6m0s."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 10) / 10:g}s"
    m, s = divmod(math.ceil(seconds), 60)
    return f"{m}m{s}s"


def quota_headers(q: Quota) -> list[tuple[bytes, bytes]]:
    return [(b"x-ratelimit-limit-tokens", str(q.limit).encode()),
            (b"x-ratelimit-remaining-tokens", str(q.remaining).encode()),
            (b"x-ratelimit-reset-tokens", reset_text(q.reset_s).encode())]


class RateLimiter:
    def __init__(self, cfg: RateLimitConfig, metrics, load: Callable[[], tuple[float | None, float | None]],
                 lease_s: float, store: BudgetStore | None = None, internal_token: str | None = None):
        """`load()` gives the fleet's mean KV usage and waiting requests per ready replica (None: unknown).
        A bad tenants file raises here (TenantsFileError, with its line), before the router serves."""
        self.cfg, self.metrics, self.load = cfg, metrics, load
        if cfg.tenants_file is None:
            raise ValueError("a rate limiter needs a tenants file (--tenants-file)")
        self.file = TenantsFile(cfg.tenants_file, on_reload=metrics.tenants_reloaded)
        if store is None:
            if cfg.redis_url:
                from router.tenants.redis_store import RedisStore

                store = RedisStore.from_url(cfg.redis_url, lease_s=lease_s,
                                            reconcile_after_s=cfg.usage_reconcile_after_s)
            else:
                store = InProcessStore(lease_s)
        self.store = store
        self.limiter = Limiter(store, OnStoreError(cfg.on_store_error), on_store_error=metrics.store_error)
        self.router_id = uuid.uuid4().hex
        self.internal_token = internal_token  # for the engines' usage lookup (router/tenants/reconcile.py)
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self.file.watch()))
        if self.cfg.redis_url:
            self._tasks.append(asyncio.create_task(self._heartbeats()))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        close = getattr(self.store, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                await close()

    async def _heartbeats(self) -> None:
        beats, every = 0, reconcile_every_beats(self.cfg.heartbeat_s, self.cfg.usage_reconcile_after_s)
        while True:
            await self.limiter.heartbeat(self.router_id, self.cfg.heartbeat_s * 3)
            if self.limiter.unsent_records:
                await self.limiter.flush_records()
            beats += 1
            if beats % every == 0:  # requests whose router died before settling them
                await self._reconcile()
            self.metrics.store_healthy.set(1 if self.limiter.healthy else 0)
            await asyncio.sleep(self.cfg.heartbeat_s)

    async def _reconcile(self) -> None:
        try:
            got = await reconcile(self.limiter, self.file.registry, self.internal_token,
                                  grace_for(self.cfg.usage_reconcile_after_s))
        except Exception:  # noqa: BLE001 - the next round tries again
            log.exception("usage ledger: reconcile failed")
            return
        if got.settled or got.lost:
            log.warning("usage ledger: %d requests no router settled recorded with what their engines said they used, "
                        "%d with their reservation (their engines did not know them)", got.settled, got.lost)

    async def attach(self, a: Budget, request_id: str, replica: str) -> None:
        """Name the replica the request goes to in its pending ledger record, before it is sent there."""
        r = a.reservation
        if r is not None and r.pending_id is not None and not r.local:
            await self.limiter.attach(r.tenant, request_id, replica)

    # -- admission -----------------------------------------------------------------------------------------
    def identify(self, headers) -> Tenant | Refusal:
        """The caller's tenant, or the 401 (before anything else is spent on the request)."""
        try:
            return self.file.registry.identify(headers)
        except AuthError as e:
            self.metrics.ratelimit_requests.labels("-", "unauthorized").inc()
            return Refusal(401, e.body(), list(e.headers), "unauthorized")

    async def reserve(self, tenant: Tenant, tokens: int, model: str | None = None,
                      ticket: Ticket | None = None, prompt_tokens: int | None = None) -> Budget | Refusal:
        """Reserve what `tokens` tokens (router/admission/stages.py `request_cost`; `prompt_tokens` of them the
        prompt's, None: unknown) of `model` cost in the tenant's budget at worst (router/tenants/pricing.py
        `reserve_units`). With a `ticket`, the shared store also keeps the record the ledger gets should this request
        never be settled (its router dies): the reservation, charged."""
        weight = self.file.registry.token_weight(model)
        prices = self.file.registry.prices(tenant.name, model)
        if tenant.cost_budget and prices is None:
            return self.refused(tenant, refuse(
                400, f"model {model!r} has no price in the tenants file, and this API key's budget is in dollars",
                "unpriced", "model", "model_not_priced"))
        cost = reserve_units(tokens, weight, prices, tenant.cost_budget, prompt_tokens)
        spec = BudgetSpec(tenant.tokens_per_minute, tenant.max_concurrent_requests)
        pending = None
        if ticket is not None:
            lost = ledger.record(ticket.request_id, tenant.name, ticket.api_key_id, model or "-", ticket.pool, None,
                                 None, cost, None, ledger.ROUTER_LOST, time.time(), 0.0, None)
            pending = (ticket.request_id, lost.to_json())
        try:
            got = await self.limiter.reserve(tenant.name, spec, cost, pending=pending)
        except LimiterUnavailable:
            return self.refused(tenant, refuse(503, "the rate limiter's store is unavailable; retry shortly",
                                               "unavailable", None, "ratelimit_unavailable", [(b"retry-after", b"1")]))
        if isinstance(got, Rejection):
            return self.refused(tenant, self._rejection(got, cost, spec, "micro-dollars" if tenant.cost_budget
                                                        else "tokens"))
        m = self.metrics
        m.ratelimit_requests.labels(tenant.name, "admitted").inc()
        m.ratelimit_tokens.labels(tenant.name, "reserved").inc(cost)
        m.reserved_outstanding.labels(tenant.name).inc(cost)
        return Budget(tenant, got, quota_headers(got.quota), weight, prices, model or "-")

    def _rejection(self, got: Rejection, cost: int, spec: BudgetSpec, unit: str = "tokens") -> Refusal:
        if got.reason is Reason.TOO_LARGE:
            return Refusal(400, error_body(
                f"this request reserves {cost} {unit} (prompt + n x max_tokens), more than this API key's whole "
                f"budget of {spec.tokens_per_minute} {unit} per minute; lower max_tokens", error_type(400),
                "max_tokens", "request_too_large"), quota_headers(got.quota), "too_large")
        retry = got.retry_after_s or 1.0
        what = ((f"{unit} per min" if unit != "tokens" else "tokens per min (TPM)") if got.reason is Reason.TOKENS
                else f"concurrent requests ({spec.max_concurrent_requests})")
        body = error_body(f"Rate limit reached on {what}: limit {got.quota.limit} {unit} per minute, "
                          f"{got.quota.remaining} remaining, {cost} requested. Please try again in "
                          f"{reset_text(retry)}.", "tokens" if got.reason is Reason.TOKENS else "requests",
                          None, "rate_limit_exceeded")
        headers = [(b"retry-after", str(max(1, math.ceil(retry))).encode()),
                   (b"retry-after-ms", str(math.ceil(retry * 1000)).encode()), *quota_headers(got.quota)]
        return Refusal(429, body, headers, f"rejected_{got.reason}")

    def refused(self, tenant: Tenant, r: Refusal) -> Refusal:
        """Count a refusal of the tenant's request (by any admission stage) and hand it on."""
        self.metrics.ratelimit_requests.labels(tenant.name, r.outcome).inc()
        return r

    # -- usage ---------------------------------------------------------------------------------------------------
    async def usage(self, tenant: Tenant, query: str) -> tuple[int, dict]:
        """(status, body) of `GET /v1/organization/usage/completions?query` for this tenant's own usage."""
        try:
            start, end, width, group = ledger.parse_query(parse_qs(query), time.time())
        except ledger.UsageQueryError as e:
            return 400, error_body(str(e), error_type(400), e.param, "invalid_value")
        try:
            rows = await self.limiter.records(tenant.name, start, end)
        except StoreError:
            return 503, error_body("the usage ledger's store is unavailable; retry shortly", error_type(503), None,
                                   "ledger_unavailable")
        return 200, ledger.usage_page([ledger.UsageRecord.from_json(r) for r in rows], start, end, width, group)

    # -- settlement ----------------------------------------------------------------------------------------
    async def settle(self, a: Budget, reported: dict | None, answered: bool, meta: RecordMeta | None = None) -> None:
        """Charge what the request used: the usage the engine reported (router/tenants/pricing.py: weighted as
        reserved, cached prompt tokens at the cached price, written ones at the cache-write price), else the whole
        reservation if a replica answered 200 (`answered`), else nothing; and with `meta`, its record in the
        tenant's usage ledger, in the same call."""
        r = a.reservation
        if r is None:
            return
        usage = usage_of(reported)
        used = (charge_units(usage, a.weight, a.prices, a.tenant.cost_budget) if usage is not None
                else (r.amount if answered else 0))
        m, name = self.metrics, a.tenant.name
        m.reserved_outstanding.labels(name).dec(r.amount)
        m.ratelimit_tokens.labels(name, "used").inc(used)
        m.ratelimit_tokens.labels(name, "refunded").inc(max(0, r.amount - used))
        if usage is not None:
            m.tenant_tokens.labels(name, a.model, "computed").inc(usage.computed_tokens)
            m.tenant_tokens.labels(name, a.model, "cached").inc(usage.cached_tokens)
            m.tenant_tokens.labels(name, a.model, "written").inc(usage.written_tokens)
            m.tenant_tokens.labels(name, a.model, "output").inc(usage.completion_tokens)
            if a.prices is not None:
                m.tenant_cost.labels(name, a.model).inc(float(cost_usd(usage, a.prices)))
        rec = None
        if meta is not None:
            rec = ledger.record(meta.request_id, name, meta.api_key_id, a.model, meta.pool, meta.replica, usage, used,
                                a.prices, meta.outcome, time.time(), meta.duration_s, meta.ttft_s).to_json()
        await self.limiter.settle(r, used, record=rec)

"""The router's tenant admission edge: who is calling, what the request may cost, whether the tenant's token
budget (router/budget*.py, router/tenants/limiter.py) and the fleet's pressure (router/admission/shedding.py) let it through,
and, once it is answered, what it really used.

Per client request, before it is routed (once, however many replicas it is retried on):
1. the API key names the tenant (router/tenants/registry.py): none or unknown -> 401 `invalid_api_key`;
2. the tenant's limits shape the body: `max_tokens` defaults to the tenant's cap, a larger one -> 400; an
   isolated tenant's `cache_salt` is forced; a stream asks the engine for usage in every chunk;
3. its cost, `sum over prompts of (prompt tokens + n x max_tokens)` (prompts counted with the engines'
   tokenizer), against the tenant's `max_context_tokens` (400) and the fleet's pressure (503 + Retry-After
   for the expensive requests of low priority);
4. the reservation: 400 if it could never fit the budget, 429 + Retry-After (`rate_limit_exceeded`) if not
   now, 503 if the store failed under `--ratelimit-on-store-error closed`.
`settle` charges what the engine reported (usage.total_tokens; the last streamed chunk's for a cancelled
stream), 0 if no replica answered with success (refused, failed, or an error answer), the whole reservation
if one answered 200 without usage. Every response to
a known tenant carries OpenAI's `x-ratelimit-{limit,remaining,reset}-tokens` headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from contract.errors import error_body, error_type
from router.admission.prepare import CHAT_PATH, max_tokens_field, positive_int
from router.admission.shedding import fleet_pressure, should_shed
from router.config import RateLimitConfig
from router.http.usage import StreamUsage, ask_for_usage
from router.tenants.budget import BudgetSpec, Quota, Reason
from router.tenants.file import TenantsFile
from router.tenants.limiter import Limiter, LimiterUnavailable, OnStoreError
from router.tenants.registry import AuthError, Tenant
from router.tenants.store import BudgetStore, InProcessStore, Rejection, Reservation

log = logging.getLogger("kvfleet.router.ratelimit")


class Refusal(NamedTuple):
    status: int
    body: dict
    headers: list[tuple[bytes, bytes]]
    outcome: str  # metrics label


@dataclass(slots=True)
class Admitted:
    tenant: Tenant
    reservation: Reservation | None  # None: the store failed open without a budget (never: see Limiter)
    body: bytes  # what goes upstream
    usage: StreamUsage
    headers: list[tuple[bytes, bytes]]  # x-ratelimit-* for the response


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
                 lease_s: float, store: BudgetStore | None = None):
        """`load()` gives the fleet's mean KV usage and waiting requests per ready replica (None: unknown).
        A bad tenants file raises here (TenantsFileError, with its line), before the router serves."""
        self.cfg, self.metrics, self.load = cfg, metrics, load
        self.file = TenantsFile(cfg.tenants_file, on_reload=metrics.tenants_reloaded)
        if store is None:
            if cfg.redis_url:
                from router.tenants.redis_store import RedisStore

                store = RedisStore.from_url(cfg.redis_url, lease_s=lease_s)
            else:
                store = InProcessStore(lease_s)
        self.store = store
        self.limiter = Limiter(store, OnStoreError(cfg.on_store_error), on_store_error=metrics.store_error)
        self.router_id = uuid.uuid4().hex
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
        while True:
            await self.limiter.heartbeat(self.router_id, self.cfg.heartbeat_s * 3)
            self.metrics.store_healthy.set(1 if self.limiter.healthy else 0)
            await asyncio.sleep(self.cfg.heartbeat_s)

    # -- admission -----------------------------------------------------------------------------------------
    def identify(self, headers) -> Tenant | Refusal:
        """The caller's tenant, or the 401 (before anything else is spent on the request)."""
        try:
            return self.file.registry.identify(headers)
        except AuthError as e:
            self.metrics.ratelimit_requests.labels("-", "unauthorized").inc()
            return Refusal(401, e.body(), list(e.headers), "unauthorized")

    def shape(self, tenant: Tenant, path: str, obj: dict) -> Refusal | None:
        """The tenant's max_tokens cap and default and its cache salt, in the parsed body (in place); a
        refusal if the request asks for more than the cap. Before `admit`, which reserves what the body
        then asks for."""
        refused = self._shape(tenant, path, obj)
        return None if refused is None else self._refused(tenant, refused)

    async def admit(self, tenant: Tenant, path: str, obj: dict, prompt_tokens: list[int]) -> Admitted | Refusal:
        """`obj` is the parsed body, shaped (`shape`), `prompt_tokens` the token count of each prompt."""
        registry = self.file.registry
        max_tokens = positive_int(obj.get(max_tokens_field(path, obj)))
        n = positive_int(obj.get("n")) or 1
        prompts = prompt_tokens or [0]
        if max_tokens is None and tenant.max_context_tokens is not None:
            max_tokens = max(0, tenant.max_context_tokens - max(prompts))  # what the engine could generate
        cost = sum(p + n * (max_tokens or 0) for p in prompts)
        if tenant.max_context_tokens is not None and max(prompts) + (max_tokens or 0) > tenant.max_context_tokens:
            return self._refused(tenant, Refusal(400, error_body(
                f"this request needs {max(prompts)} prompt tokens + {max_tokens} max_tokens, more than this API "
                f"key's context limit of {tenant.max_context_tokens} tokens", error_type(400),
                "messages" if path == CHAT_PATH else "prompt", "context_length_exceeded"), [], "context_too_long"))
        lowest, highest = registry.priorities()
        kv, waiting = self.load()
        pressure = fleet_pressure(kv, waiting, self.cfg.shedding)
        if should_shed(pressure, cost, tenant.priority, lowest, highest, self.cfg.shedding):
            retry = self.cfg.shedding.retry_after_s
            return self._refused(tenant, Refusal(503, error_body(
                f"the fleet is under {pressure} load; requests of this size and priority are shed: retry in "
                f"{retry}s or lower max_tokens", error_type(503), None, "overloaded"),
                [(b"retry-after", str(retry).encode())], "shed"))
        spec = BudgetSpec(tenant.tokens_per_minute, tenant.max_concurrent_requests)
        try:
            got = await self.limiter.reserve(tenant.name, spec, cost)
        except LimiterUnavailable:
            return self._refused(tenant, Refusal(503, error_body(
                "the rate limiter's store is unavailable; retry shortly", error_type(503), None,
                "ratelimit_unavailable"), [(b"retry-after", b"1")], "unavailable"))
        if isinstance(got, Rejection):
            return self._refused(tenant, self._rejection(got, cost, spec))
        m = self.metrics
        m.ratelimit_requests.labels(tenant.name, "admitted").inc()
        m.ratelimit_tokens.labels(tenant.name, "reserved").inc(cost)
        m.reserved_outstanding.labels(tenant.name).inc(cost)
        stream = obj.get("stream") is True
        usage = StreamUsage(ask_for_usage(obj) if stream else None)
        body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
        return Admitted(tenant, got, body, usage, quota_headers(got.quota))

    def _shape(self, tenant: Tenant, path: str, obj: dict) -> Refusal | None:
        """The tenant's cap and default for max_tokens and its cache salt, in the body; a refusal if the
        request asks for more than the cap."""
        cap = tenant.max_tokens
        names = ("max_completion_tokens", "max_tokens") if path == CHAT_PATH else ("max_tokens",)
        asked = [(k, obj[k]) for k in names if obj.get(k) is not None]
        if cap is not None:
            for k, v in asked:
                if positive_int(v) is not None and v > cap:
                    return Refusal(400, error_body(f"{k} is {v}, above this API key's limit of {cap}",
                                                   error_type(400), k, "invalid_value"), [], "max_tokens_above_cap")
            if not asked:
                obj[names[0]] = cap
        salt = tenant.request_cache_salt(obj.get("cache_salt") if isinstance(obj.get("cache_salt"), str) else None)
        if salt is not None:
            obj["cache_salt"] = salt
        return None

    def _rejection(self, got: Rejection, cost: int, spec: BudgetSpec) -> Refusal:
        if got.reason is Reason.TOO_LARGE:
            return Refusal(400, error_body(
                f"this request reserves {cost} tokens (prompt + n x max_tokens), more than this API key's whole "
                f"budget of {spec.tokens_per_minute} tokens per minute; lower max_tokens", error_type(400),
                "max_tokens", "request_too_large"), quota_headers(got.quota), "too_large")
        retry = got.retry_after_s or 1.0
        what = ("tokens per min (TPM)" if got.reason is Reason.TOKENS
                else f"concurrent requests ({spec.max_concurrent_requests})")
        body = error_body(f"Rate limit reached on {what}: limit {got.quota.limit} tokens per minute, "
                          f"{got.quota.remaining} remaining, {cost} requested. Please try again in "
                          f"{reset_text(retry)}.", "tokens" if got.reason is Reason.TOKENS else "requests",
                          None, "rate_limit_exceeded")
        headers = [(b"retry-after", str(max(1, math.ceil(retry))).encode()),
                   (b"retry-after-ms", str(math.ceil(retry * 1000)).encode()), *quota_headers(got.quota)]
        return Refusal(429, body, headers, f"rejected_{got.reason}")

    def _refused(self, tenant: Tenant, r: Refusal) -> Refusal:
        self.metrics.ratelimit_requests.labels(tenant.name, r.outcome).inc()
        return r

    # -- settlement ----------------------------------------------------------------------------------------
    async def settle(self, a: Admitted, answered: bool) -> None:
        """Charge what the request used: the engine's usage, else the whole reservation if a replica answered
        200 (`answered`), else nothing."""
        r = a.reservation
        if r is None:
            return
        used = a.usage.used if a.usage.used is not None else (r.amount if answered else 0)
        m, name = self.metrics, a.tenant.name
        m.reserved_outstanding.labels(name).dec(r.amount)
        m.ratelimit_tokens.labels(name, "used").inc(used)
        m.ratelimit_tokens.labels(name, "refunded").inc(max(0, r.amount - used))
        await self.limiter.settle(r, used)

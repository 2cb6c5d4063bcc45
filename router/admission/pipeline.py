"""The admission pipeline: router/admission/stages.py in order, with the metrics each refusal counts under and
the one step that does I/O (the budget reservation, router/tenants/ratelimit.py).

  identify tenant (401) -> model (400 / 404 / 503: router/pools/models.py)
  -> tenant limits (cap, default, salt) -> choose pool (among the model's: context, weights)
  -> pool caps (default, cap; + the tenant's context limit) -> shedding (one pressure reading)
  -> budget reservation (429 / 400 / 503)

The request is never changed in place: each stage returns a new typed request (contract/request.py), and
`Admitted.request` is what goes upstream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from contract.request import OpenAIRequest
from router.admission.shedding import Pressure, fleet_pressure
from router.admission.stages import (
    model_choice,
    pool_caps,
    pool_choice,
    pressure,
    request_cost,
    shed,
    tenant_context,
    tenant_limits,
)
from router.config import SheddingConfig
from router.pools.choice import PoolSpec
from router.pools.control import Pools
from router.refusal import Refusal
from router.tenants.ledger import Ticket
from router.tenants.ratelimit import Budget, RateLimiter
from router.tenants.registry import Tenant

LOWERED_HEADER = b"x-kvfleet-max-tokens-lowered"
POOL_HEADER = b"x-kvfleet-pool"


@dataclass(frozen=True, slots=True)
class Admitted:
    request: OpenAIRequest  # as it goes upstream
    pool: PoolSpec
    budget: Budget | None  # the tenant's reservation (None: no tenants file)
    headers: list[tuple[bytes, bytes]]  # for the response: pool, max_tokens lowered, x-ratelimit-*


class Admission:
    def __init__(self, pools: Pools, ratelimit: RateLimiter | None, metrics, shedding: SheddingConfig,
                 default_model: str | None = None):
        self.pools, self.ratelimit, self.metrics, self.shedding = pools, ratelimit, metrics, shedding
        self.default_model = default_model

    def identify(self, headers) -> Tenant | Refusal | None:
        """The caller's tenant (None without a tenants file), or the 401."""
        return self.ratelimit.identify(headers) if self.ratelimit is not None else None

    def _limiter(self) -> RateLimiter:
        """The rate limiter, there whenever a request has a tenant (only it identifies tenants)."""
        if self.ratelimit is None:
            raise RuntimeError("a request has a tenant but the router has no tenants file")
        return self.ratelimit

    def _refused(self, tenant: Tenant | None, refusal: Refusal) -> Refusal:
        """The refusal as the tenant's rate limiter reports it (counted, with its headers); as is without one."""
        return self._limiter().refused(tenant, refusal) if tenant is not None else refusal

    def model(self, req: OpenAIRequest, tenant: Tenant | None) -> OpenAIRequest | Refusal:
        """The request with the model it names (or `--default-model`), one some pool serves and the tenant may
        use; else the refusal (before the prompt is tokenized: the model decides the tokenizer)."""
        got = model_choice(req, tenant, self.default_model, self.pools.catalog)
        if isinstance(got, Refusal):
            self.metrics.pool_requests.labels("none", "-", "-", str(got.status)).inc()
            return self._refused(tenant, got)
        return got

    async def admit(self, req: OpenAIRequest, tenant: Tenant | None, session_key: str | None,
                    prompt_tokens: Sequence[int], request_id: str | None = None,
                    api_key_id: str | None = None,
                    slo: Callable[[PoolSpec], Refusal | None] | None = None) -> Admitted | Refusal:
        """`req` is one `model()` passed: its model is served. `request_id` / `api_key_id`: for the usage ledger's
        record of the request should its router die before settling it. `slo`: given the pool, the refusal of a
        request whose latency target (its own, its tenant's or the pool's) no replica there is predicted to meet."""
        m = self.metrics
        model = req.model
        if model is None:
            raise ValueError("admit() takes a request that model() passed: it names its model")
        if tenant is not None:
            got = tenant_limits(req, tenant)
            if isinstance(got, Refusal):
                return self._refused(tenant, got)
            req = got
        pool = pool_choice(self.pools.choose(model, session_key, max(prompt_tokens, default=0), req.max_tokens), req)
        if isinstance(pool, Refusal):
            m.pool_requests.labels("none", "-", model, str(pool.status)).inc()
            return self._refused(tenant, pool)
        version = self.pools.version(pool.name)
        req, lowered = pool_caps(req, pool)
        if lowered is not None:
            m.pool_lowered.labels(pool.name, version, model).inc()
        if tenant is not None:
            too_long = tenant_context(req, tenant, prompt_tokens)
            if too_long is not None:
                return self._refused(tenant, too_long)
        cost = request_cost(req, prompt_tokens, tenant.max_context_tokens if tenant is not None else None)
        sheds = self.pools.shedding(pool.name)
        fleet = fleet_pressure(*self.ratelimit.load(), self.shedding) if self.ratelimit is not None else Pressure.NONE
        reading = pressure(fleet, sheds)
        priority, priorities = ((tenant.priority, self._limiter().file.registry.priorities()) if tenant is not None
                                else (0, (0, 0)))
        refused = shed(reading, cost, priority, priorities, pool.name, sheds, self.shedding)
        if refused is not None:
            if sheds:
                m.pool_requests.labels(pool.name, version, model, "503").inc()
            return self._refused(tenant, refused)
        if slo is not None and (late := slo(pool)) is not None:
            m.pool_requests.labels(pool.name, version, model, "429").inc()
            return self._refused(tenant, late)
        headers = [(POOL_HEADER, pool.name.encode())]
        if lowered is not None:
            headers.append((LOWERED_HEADER, str(lowered).encode()))
        budget = None
        if tenant is not None:
            ticket = Ticket(request_id, api_key_id, pool.name) if request_id is not None else None
            got_budget = await self._limiter().reserve(tenant, cost, model, ticket, sum(prompt_tokens))
            if isinstance(got_budget, Refusal):
                return got_budget
            budget = got_budget
            headers.extend(budget.headers)
        return Admitted(req, pool, budget, headers)

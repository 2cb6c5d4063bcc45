"""The admission stages, pure: each takes the typed request (contract/request.py) and what it needs to know,
and returns a new request or a `Refusal` (an OpenAI error with its status and headers). No I/O, no clock:
router/admission/pipeline.py runs them in order and reserves the budget.

  identify tenant -> model -> tenant limits -> choose pool -> pool caps (+ tenant context) -> shedding -> budget
"""

from __future__ import annotations

from collections.abc import Sequence

from contract.request import OpenAIRequest
from router.admission.shedding import Pressure, should_shed
from router.config import SheddingConfig
from router.pools.choice import PoolChoice, PoolRefusal, PoolSpec, apply_caps
from router.pools.models import ModelCatalog, resolve_model
from router.refusal import Refusal, refuse
from router.tenants.registry import Tenant


def model_choice(req: OpenAIRequest, tenant: Tenant | None, default_model: str | None,
                 cat: ModelCatalog) -> OpenAIRequest | Refusal:
    """The request for a model some pool serves and the tenant may use (router/pools/models.py), with
    `--default-model` written in when it named none; else 400 / 404 / 503."""
    got = resolve_model(req.model, default_model, tenant.models if tenant is not None else None, cat)
    if isinstance(got, Refusal):
        return got
    return req if got[0] == req.model else req.with_fields(model=got[0])


def tenant_limits(req: OpenAIRequest, tenant: Tenant) -> OpenAIRequest | Refusal:
    """The tenant's max_tokens cap (a larger value: 400 naming its field; no value: the cap, which is the
    tenant's default) and its forced cache salt."""
    cap = tenant.max_tokens
    if cap is not None:
        for name in ("max_completion_tokens", "max_tokens"):
            v = req.get(name)
            if isinstance(v, int) and v > cap:
                return refuse(400, f"{name} is {v}, above this API key's limit of {cap}", "max_tokens_above_cap",
                              name, "invalid_value")
        if req.max_tokens is None:
            req = req.with_max_tokens(cap)
    salt = tenant.request_cache_salt(req.cache_salt)
    if salt is not None and salt != req.cache_salt:
        req = req.with_fields(cache_salt=salt)
    return req


def pool_choice(choice: PoolChoice | PoolRefusal, req: OpenAIRequest) -> PoolSpec | Refusal:
    """The pool router/pools/ chose, or its refusal as an OpenAI error (400 names the prompt field)."""
    if isinstance(choice, PoolRefusal):
        param = req.endpoint.prompt_field if choice.status == 400 else None
        return refuse(choice.status, choice.message, "no_pool", param, choice.code)
    return choice.pool


def pool_caps(req: OpenAIRequest, pool: PoolSpec) -> tuple[OpenAIRequest, int | None]:
    """The pool's default and cap applied (a cap holds whatever the client sends or omits); the second item
    is the max_tokens a cap lowered the request to (None: not lowered)."""
    effective, lowered = apply_caps(pool, req.max_tokens)
    if effective is not None and effective != req.max_tokens:
        req = req.with_max_tokens(effective)
    return req, effective if lowered else None


def request_cost(req: OpenAIRequest, prompt_tokens: Sequence[int], context_limit: int | None = None) -> int:
    """The tokens a request can use: sum over its prompts of (prompt + n x max_tokens); with no limit named,
    what a `context_limit` leaves after the longest prompt (0 without one)."""
    prompts = list(prompt_tokens) or [0]
    limit = req.limit
    if limit is None and context_limit is not None:
        limit = max(0, context_limit - max(prompts))
    return sum(p + req.n * (limit or 0) for p in prompts)


def tenant_context(req: OpenAIRequest, tenant: Tenant, prompt_tokens: Sequence[int]) -> Refusal | None:
    """400 when the longest prompt plus max_tokens passes the tenant's context limit."""
    limit = tenant.max_context_tokens
    longest = max(prompt_tokens, default=0)
    if limit is None or longest + (req.limit or 0) <= limit:
        return None
    return refuse(400, f"this request needs {longest} prompt tokens + {req.limit} max_tokens, more than this API "
                  f"key's context limit of {limit} tokens", "context_too_long", req.endpoint.prompt_field,
                  "context_length_exceeded")


def pressure(fleet: Pressure, pool_sheds: bool) -> Pressure:
    """The one pressure reading shedding decides on: the fleet's, and at least HIGH in a degraded pool that
    sheds."""
    if pool_sheds and fleet is Pressure.NONE:
        return Pressure.HIGH
    return fleet


def shed(reading: Pressure, cost: int, priority: int, priorities: tuple[int, int], pool: str, pool_sheds: bool,
         cfg: SheddingConfig) -> Refusal | None:
    """503 + Retry-After for a request that `should_shed` under this pressure (router/admission/shedding.py)."""
    lowest, highest = priorities
    if not should_shed(reading, cost, priority, lowest, highest, cfg):
        return None
    retry = cfg.retry_after_s
    what = (f"pool {pool} is degraded and sheds" if pool_sheds and reading is Pressure.HIGH
            else f"the fleet is under {reading} load; it sheds")
    return refuse(503, f"{what} requests of this size and priority: retry in {retry}s or lower max_tokens",
                  "shed", None, "overloaded", [(b"retry-after", str(retry).encode())])

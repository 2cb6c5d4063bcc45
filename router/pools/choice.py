"""Engine pools: which pool a request goes to, and the max_tokens caps a pool applies. Pure: the router
passes the pools, the request's session key and sizes, and a random source in.

Choice, in order:
1. A pool *admits* a request when prompt_tokens + its effective max_tokens (after `apply_caps` for that
   pool) is at most the pool's `max_context_tokens` (None: no limit). A request without max_tokens in a
   pool with neither a default nor a cap counts its prompt only.
2. Among the regular (not long-context) pools with weight > 0 that admit the request, a weighted choice
   (pools with role `prefill` are never chosen: they prefill for `decode` pools, router/http/disagg.py).
   If none admits it but some regular pool has weight > 0, the long-context pools with weight > 0 that
   admit it are tried the same way; failing those, a 400 refusal naming the largest context limit.
   If no regular pool has weight > 0 at all, a 503 refusal.

Weighted choice with a session key is weighted rendezvous (highest-random-weight) hashing: each pool
scores -weight / ln(u), u uniform in (0, 1) from xxh3_64(salt_seed, session key, pool name); the highest
score wins. So:
- a session keeps its pool on every call while the pool set and weights stay the same (stickiness);
- pool i wins with probability weight_i / sum(weights);
- changing one pool's weight leaves every other pool's score unchanged: growing pool P moves sessions
  only *into* P, shrinking P moves sessions only *out of* P, and sessions between two other pools never move;
- weight 0 drains a pool: it gets no new sessions, and its existing sessions move to the other pools on
  their next request (stickiness is by hashing, not by remembered assignment), losing their cached prefix.
Without a session key the choice draws from the injected `random.Random`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from contract.errors import ConfigError

_2_64 = float(1 << 64)
ROLES = ("both", "prefill", "decode")
SLO_UNATTAINABLE = ("refuse", "best_effort")  # what a pool does with a target no replica is predicted to meet


def _optional_positive(field: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(field, f"{field} must be a positive integer or None, got {value!r}")


@dataclass(frozen=True)
class PoolSpec:
    """One engine pool: its name, configuration version label, canary weight and limits."""

    name: str
    version: str
    weight: int
    max_tokens_cap: int | None = None
    default_max_tokens: int | None = None
    max_context_tokens: int | None = None
    long_context: bool = False
    canary: bool = False  # degradation may roll it back (weight -> 0) when it misbehaves
    models: tuple[str, ...] = ()  # the model names it serves; (): learned from its replicas' /v1/models
    adapters: tuple[tuple[str, str], ...] = ()  # LoRA adapters (name, path on the engines) loaded on demand
    # prefill/decode disaggregation (router/http/disagg.py): "prefill" pools only prefill for "decode" pools of the
    # same model (never chosen here); a "decode" pool's requests are prefilled there first; "both": colocated
    role: str = "both"
    slo_ttft_s: float | None = None  # the TTFT target of its requests that carry none, nor their tenant (contract/slo.py)
    slo_tpot_s: float | None = None  # the TPOT target likewise
    # a request no replica is predicted to serve within its targets: "refuse" (429 slo_unattainable) or
    # "best_effort" (served, at a lower priority than the pool's other requests)
    slo_unattainable: str = "refuse"

    def __post_init__(self) -> None:
        for field in ("name", "version"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value:
                raise ConfigError(field, f"pool {field} must be a non-empty string, got {value!r}")
        if not isinstance(self.models, tuple) or not all(isinstance(m, str) and m for m in self.models) \
                or len(set(self.models)) != len(self.models):
            raise ConfigError("models", f"pool {self.name}: models must be distinct non-empty names, got "
                              f"{self.models!r}")
        if not isinstance(self.adapters, tuple) or not all(
                isinstance(a, tuple) and len(a) == 2 and all(isinstance(v, str) and v for v in a) for a in self.adapters) \
                or len({name for name, _ in self.adapters}) != len(self.adapters):
            raise ConfigError("adapters", f"pool {self.name}: adapters must be distinct names with a path each, got "
                              f"{self.adapters!r}")
        if isinstance(self.weight, bool) or not isinstance(self.weight, int) or self.weight < 0:
            raise ConfigError("weight", f"pool {self.name}: weight must be an integer >= 0, got {self.weight!r}")
        _optional_positive("max_tokens_cap", self.max_tokens_cap)
        _optional_positive("default_max_tokens", self.default_max_tokens)
        _optional_positive("max_context_tokens", self.max_context_tokens)
        if self.role not in ROLES:
            raise ConfigError("role", f"pool {self.name}: role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.slo_unattainable not in SLO_UNATTAINABLE:
            raise ConfigError("slo_unattainable", f"pool {self.name}: slo_unattainable must be one of "
                              f"{', '.join(SLO_UNATTAINABLE)}, got {self.slo_unattainable!r}")
        for flag in ("long_context", "canary"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(flag, f"pool {self.name}: {flag} must be a bool")
        if (self.default_max_tokens is not None and self.max_tokens_cap is not None
                and self.default_max_tokens > self.max_tokens_cap):
            raise ConfigError("default_max_tokens", f"pool {self.name}: default_max_tokens "
                              f"{self.default_max_tokens} is above max_tokens_cap {self.max_tokens_cap}")
        if (self.default_max_tokens is not None and self.max_context_tokens is not None
                and self.default_max_tokens >= self.max_context_tokens):
            raise ConfigError("default_max_tokens", f"pool {self.name}: default_max_tokens "
                              f"{self.default_max_tokens} leaves no room under max_context_tokens "
                              f"{self.max_context_tokens}")


def check_pools(pools: Sequence[PoolSpec]) -> None:
    """Raise ConfigError unless there is at least one pool and the names are unique."""
    if not pools:
        raise ConfigError("pools", "at least one pool is required")
    names = [p.name for p in pools]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError("name", f"pool name {name!r} appears more than once")


@dataclass(frozen=True)
class PoolChoice:
    pool: PoolSpec


@dataclass(frozen=True)
class PoolRefusal:
    """No pool takes the request: `status` (400 or 503), `code` and a message for the error body."""

    status: int
    code: str
    message: str


def apply_caps(pool: PoolSpec, requested_max_tokens: int | None) -> tuple[int | None, bool]:
    """(effective max_tokens, lowered) in this pool; a cap holds whatever the client sends or omits: its
    cap when the request asks for more (lowered); with none requested, the pool's default, else its cap
    (lowered: the request had no limit), else None (the engine's own default applies)."""
    cap = pool.max_tokens_cap
    if requested_max_tokens is None:
        if pool.default_max_tokens is not None:
            return pool.default_max_tokens, False
        return cap, cap is not None
    if cap is not None and requested_max_tokens > cap:
        return cap, True
    return requested_max_tokens, False


def admits(pool: PoolSpec, prompt_tokens: int, max_tokens: int | None) -> bool:
    """Whether prompt + the pool's effective max_tokens fits the pool's context limit."""
    if pool.max_context_tokens is None:
        return True
    effective, _ = apply_caps(pool, max_tokens)
    return prompt_tokens + (effective or 0) <= pool.max_context_tokens


def hrw_score(pool: PoolSpec, session_key: str, salt_seed: int) -> float:
    """The pool's weighted rendezvous score for a session (higher wins); -inf for weight 0."""
    if pool.weight == 0:
        return -math.inf
    h = xxhash.xxh3_64_intdigest(f"{session_key}\x00{pool.name}".encode(), seed=salt_seed)
    u = (h + 0.5) / _2_64  # in (0, 1)
    return -pool.weight / math.log(u)


def _weighted(candidates: Sequence[PoolSpec], session_key: str | None, salt_seed: int,
              rng: random.Random) -> PoolSpec:
    if session_key is not None:
        return max(candidates, key=lambda p: hrw_score(p, session_key, salt_seed))
    x = rng.random() * sum(p.weight for p in candidates)
    for pool in candidates:
        x -= pool.weight
        if x < 0:
            return pool
    return candidates[-1]


def choose_pool(pools: Sequence[PoolSpec], session_key: str | None, prompt_tokens: int,
                max_tokens: int | None, salt_seed: int, rng: random.Random) -> PoolChoice | PoolRefusal:
    """The pool for one request (rules in the module docstring)."""
    pools = [p for p in pools if p.role != "prefill"]  # they take requests from decode pools only
    regular = [p for p in pools if not p.long_context and p.weight > 0]
    if not regular:
        return PoolRefusal(503, "no_pool", "no engine pool accepts new requests (every weight is 0)")
    for group in (regular, [p for p in pools if p.long_context and p.weight > 0]):
        candidates = [p for p in group if admits(p, prompt_tokens, max_tokens)]
        if candidates:
            return PoolChoice(_weighted(candidates, session_key, salt_seed, rng))
    limits = [p.max_context_tokens for p in pools if p.weight > 0 and p.max_context_tokens is not None]
    requested = "" if max_tokens is None else f" + max_tokens ({max_tokens})"
    return PoolRefusal(400, "context_length_exceeded",
                       f"prompt ({prompt_tokens} tokens){requested} exceeds the largest pool context "
                       f"limit of {max(limits)} tokens")

"""Load shedding under fleet pressure: which requests the router refuses (503 + Retry-After) before they
reach a replica, when the fleet's KV cache is nearly full and queues grow. Pure: the router passes the
fleet's scraped load and the request's cost and tenant priority in.

Pressure, from the ready replicas whose load is known (mean KV usage, waiting requests per replica):
- HIGH: KV usage >= `kv_high` and waiting per replica >= `waiting_high`;
- CRITICAL: KV usage >= `kv_critical` or waiting per replica >= `waiting_critical` (with KV usage >= kv_high).

Who is shed, the most expensive requests of the lowest priority first (cost: the tokens a request
reserves, prompt + n x max_tokens; priority: the tenant's, higher is shed last):
- HIGH: requests of the lowest priority costing >= `min_cost_tokens`;
- CRITICAL: those, plus requests of the lowest priority costing >= min_cost_tokens / 4 and requests of any
  priority but the highest costing >= `min_cost_tokens`.
The highest priority is never shed while a lower one exists; with a single priority level the rules for
the lowest apply to everyone.
"""

from __future__ import annotations

from router.config import SheddingConfig
from router.states import StrEnum


class Pressure(StrEnum):
    NONE = "none"
    HIGH = "high"
    CRITICAL = "critical"


def fleet_pressure(kv_usage: float | None, waiting_per_replica: float | None, cfg: SheddingConfig) -> Pressure:
    """The fleet's pressure from its mean KV usage (0..1) and waiting requests per ready replica; None (no
    replica's load is known) is no pressure."""
    if kv_usage is None or waiting_per_replica is None or kv_usage < cfg.kv_high:
        return Pressure.NONE
    if kv_usage >= cfg.kv_critical or waiting_per_replica >= cfg.waiting_critical:
        return Pressure.CRITICAL
    return Pressure.HIGH if waiting_per_replica >= cfg.waiting_high else Pressure.NONE


def should_shed(pressure: Pressure, cost_tokens: int, priority: int, lowest: int, highest: int,
                cfg: SheddingConfig) -> bool:
    """Whether to refuse a request costing `cost_tokens` from a tenant of `priority`, where the tenants'
    priorities span lowest..highest."""
    if pressure is Pressure.NONE or (priority == highest and lowest < highest):
        return False
    big = cost_tokens >= cfg.min_cost_tokens
    if pressure is Pressure.HIGH:
        return priority <= lowest and big
    return big or (priority <= lowest and cost_tokens >= cfg.min_cost_tokens // 4)

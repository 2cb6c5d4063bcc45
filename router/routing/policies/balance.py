"""Cache-blind baselines: `least-load` and `round-robin` over every routable replica (overloaded or not)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from router.routing.policies.base import Decision, PolicyNeeds, Reason, ReplicaView, RouteRequest
from router.routing.policies.load import decision, effective_loads, least_load, routable

if TYPE_CHECKING:
    from router.config import ScoringConfig
    from router.routing.policies.ring import HashRing


@dataclass(frozen=True, slots=True)
class LeastLoadPolicy:
    """The replica with the fewest queued requests (then KV usage, then this router's in-flight count)."""

    name: str = "least-load"
    needs: PolicyNeeds = field(default_factory=PolicyNeeds)

    def choose(self, views: Sequence[ReplicaView], req: RouteRequest, cfg: ScoringConfig, ring: HashRing,
               turn: int) -> Decision | None:
        idx = routable(views)
        if not idx:
            return None
        loads = effective_loads(views)
        return decision(views, loads, req, cfg, least_load(views, loads, idx, turn), Reason.LEAST_LOAD)


@dataclass(frozen=True, slots=True)
class RoundRobinPolicy:
    """The turn-th routable replica in URL order."""

    name: str = "round-robin"
    needs: PolicyNeeds = field(default_factory=PolicyNeeds)

    def choose(self, views: Sequence[ReplicaView], req: RouteRequest, cfg: ScoringConfig, ring: HashRing,
               turn: int) -> Decision | None:
        idx = sorted(routable(views), key=lambda i: views[i].url)
        if not idx:
            return None
        return decision(views, effective_loads(views), req, cfg, idx[turn % len(idx)], Reason.ROUND_ROBIN)


LEAST_LOAD = LeastLoadPolicy()
ROUND_ROBIN = RoundRobinPolicy()

"""`session`: consistent hashing with bounded load on the session key; no key → the least-loaded replica.
Overloaded replicas are left out for the request (all of them in, if every one is)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from router.routing.policies.base import Decision, PolicyNeeds, Reason, ReplicaView, RouteRequest
from router.routing.policies.load import decision, effective_loads, least_load, pool

if TYPE_CHECKING:
    from router.config import ScoringConfig
    from router.routing.policies.ring import HashRing


@dataclass(frozen=True, slots=True)
class SessionPolicy:
    name: str = "session"
    needs: PolicyNeeds = field(default_factory=PolicyNeeds)

    def choose(self, views: Sequence[ReplicaView], req: RouteRequest, cfg: ScoringConfig, ring: HashRing,
               turn: int) -> Decision | None:
        idx, _ = pool(views, cfg)
        if not idx:
            return None
        loads = effective_loads(views)
        if req.session_key is None:
            return decision(views, loads, req, cfg, least_load(views, loads, idx, turn), Reason.LEAST_LOAD)
        best = ring.choose(req.session_key, views, loads, idx, cfg.session_load_factor)
        return decision(views, loads, req, cfg, best, Reason.SESSION)


SESSION = SessionPolicy()

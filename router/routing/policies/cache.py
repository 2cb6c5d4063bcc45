"""`kv` and `approx-prefix`: the lowest-cost replica by predicted prefix-cache hit against load.

Affinity yields per request: an overloaded replica is left out, and a cache miss never goes to one. A request
for a LoRA adapter that some replicas hold and others do not is scored the same way (the cost counts an adapter
load where it is missing: router/routing/adapters.py). When no routable replica holds any of the prompt (nor is
the only one with its adapter), a session key picks a replica on the hash ring (bounded load),
otherwise the least-loaded one wins. The two policies differ only in where the hits come from: the exact
index mirrored from KV events (the approximate one for replicas without them), or the approximate index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from router.routing.policies.base import Decision, PolicyNeeds, Reason, ReplicaView, RouteRequest
from router.routing.policies.load import cost, decision, effective_loads, least_load, pick, pool

if TYPE_CHECKING:
    from router.config import ScoringConfig
    from router.routing.policies.ring import HashRing


@dataclass(frozen=True, slots=True)
class CachePolicy:
    name: str
    needs: PolicyNeeds

    def choose(self, views: Sequence[ReplicaView], req: RouteRequest, cfg: ScoringConfig, ring: HashRing,
               turn: int) -> Decision | None:
        idx, all_overloaded = pool(views, cfg)
        if not idx:
            return None
        loads = effective_loads(views)
        if all_overloaded:
            best = pick(idx, lambda i: cost(views[i], loads[i], req, cfg), turn)
            return decision(views, loads, req, cfg, best, Reason.ALL_OVERLOADED)
        holders = sum(1 for i in idx if not views[i].adapter_missing)
        if any(views[i].cached_tokens > 0 or views[i].tier_tokens > 0 for i in idx) or 0 < holders < len(idx):
            # a prefix (in a cache or a lower tier) or an adapter is here
            best = pick(idx, lambda i: (cost(views[i], loads[i], req, cfg), -views[i].cached_tokens), turn)
            d = decision(views, loads, req, cfg, best, Reason.CACHE)
            return d if d.predicted_cached_tokens > 0 else replace(d, reason=Reason.ADAPTER)
        if req.session_key is not None:
            best = ring.choose(req.session_key, views, loads, idx, cfg.session_load_factor)
            return decision(views, loads, req, cfg, best, Reason.SESSION)
        return decision(views, loads, req, cfg, least_load(views, loads, idx, turn), Reason.LEAST_LOAD)


KV = CachePolicy("kv", PolicyNeeds(kv_events=True, approx_index=True))
APPROX_PREFIX = CachePolicy("approx-prefix", PolicyNeeds(approx_index=True))

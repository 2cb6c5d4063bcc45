"""Routing policies as objects behind one interface (`Policy`, in base.py), and the registry that maps a
configured name to its object. Policies are pure: the live router (router/routing/fleet.py), a fleet simulator and a
Ray Serve request router call them alike."""

from __future__ import annotations

from router.routing.policies.balance import LEAST_LOAD, ROUND_ROBIN
from router.routing.policies.base import (
           Decision,
           IndexKind,
           Policy,
           PolicyNeeds,
           Reason,
           ReplicaView,
           RouteRequest,
)
from router.routing.policies.cache import APPROX_PREFIX, KV
from router.routing.policies.ring import HashRing
from router.routing.policies.session import SESSION

POLICIES: dict[str, Policy] = {p.name: p for p in (KV, APPROX_PREFIX, SESSION, LEAST_LOAD, ROUND_ROBIN)}

__all__ = ["POLICIES", "Decision", "HashRing", "IndexKind", "Policy", "PolicyNeeds", "Reason", "ReplicaView",
           "RouteRequest"]

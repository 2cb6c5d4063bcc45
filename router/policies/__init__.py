"""Routing policies as objects behind one interface (`Policy`, in base.py), and the registry that maps a
configured name to its object. Policies are pure: the live router (router/fleet.py), a fleet simulator and a
Ray Serve request router call them alike."""

from __future__ import annotations

from router.policies.balance import LEAST_LOAD, ROUND_ROBIN
from router.policies.base import Decision, IndexKind, Policy, PolicyNeeds, Reason, ReplicaView, RouteRequest
from router.policies.cache import APPROX_PREFIX, KV
from router.policies.ring import HashRing
from router.policies.session import SESSION

POLICIES: dict[str, Policy] = {p.name: p for p in (KV, APPROX_PREFIX, SESSION, LEAST_LOAD, ROUND_ROBIN)}

__all__ = ["POLICIES", "Decision", "HashRing", "IndexKind", "Policy", "PolicyNeeds", "Reason", "ReplicaView",
           "RouteRequest"]

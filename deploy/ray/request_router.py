"""The Serve request router of the engine deployment: kvfleet's own routing policy objects (router/routing/policies/:
`kv`, `approx-prefix`, `session`, `least-load`, `round-robin` - the code the HTTP router runs) deciding among
Serve's RunningReplicas.

Configured in the deployment's `request_router_config` (app.py sets it):

    request_router_class: deploy.ray.request_router:KVRequestRouter
    request_router_kwargs: {policy: kv, scoring: {...}, block_size: 16, hash_seed: ...}

Serve builds one instance per DeploymentHandle (here: one per ingress replica), so each keeps its own
RoutingState (routing_state.py), around the HTTP router's own placement core (router/routing/placement.py):
- the exact PrefixIndex, fed by a KV event subscription to every engine replica over Ray (kv_subscription.py)
  when the policy needs KV events; the ApproxPrefixIndex (where this router sent prompts) for `approx-prefix`;
- load: each replica's `record_routing_stats` (KV usage, running, waiting; refreshed every
  `request_routing_stats_period_s` through the controller), plus the requests this router sent since that
  report and its own in-flight ones, as the HTTP router counts them between /metrics scrapes.

The ingress tokenizes and hashes each prompt once and passes a RouteHint (route_hint.py) as the `route`
keyword argument; this router only looks the hashes up. Requests without one are routed by load alone; a
call with `replica=<replica id>` (PIN_KWARG) goes to that replica only (loadtest/ray_serve.py reads each
engine's /metrics that way). The
chosen replica is ranked first and the others after it, so Serve falls back to them only when the chosen one
is at its max_ongoing_requests.
"""

from __future__ import annotations

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from deploy.ray.kv_subscription import stream_from_replica
from deploy.ray.route_hint import PIN_KWARG, ROUTE_KWARG, RouteHint
from deploy.ray.routing_state import RoutingState


def route_hint(pending_request: PendingRequest | None) -> RouteHint | None:
    hint = pending_request.kwargs.get(ROUTE_KWARG) if pending_request is not None else None
    return hint if isinstance(hint, RouteHint) else None


class KVRequestRouter(FIFOMixin, RequestRouter):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.state = RoutingState()

    def initialize_state(self, **kwargs) -> None:
        """Serve passes request_router_kwargs here (RoutingState's arguments)."""
        self.state.close()
        self.state = RoutingState(**kwargs)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        by_key = {r.replica_id.unique_id: r for r in replicas}
        self.state.set_replicas(by_key, lambda key: stream_from_replica(by_key[key], "kv_events"))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        pin = pending_request.kwargs.get(PIN_KWARG) if pending_request is not None else None
        if pin is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == pin]]
        for r in candidate_replicas:
            self.state.on_stats(r.replica_id.unique_id, r.routing_stats)
        decision = self.state.choose([r.replica_id.unique_id for r in candidate_replicas], route_hint(pending_request))
        if decision is None:
            return [candidate_replicas] if candidate_replicas else []
        chosen = [r for r in candidate_replicas if r.replica_id.unique_id == decision.url]
        rest = [r for r in candidate_replicas if r.replica_id.unique_id != decision.url]
        if pending_request is not None:  # read back in on_request_routed
            pending_request.routing_context.kvfleet_cached = decision.predicted_cached_tokens
        return [chosen, rest] if rest else [chosen]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        self.state.on_routed(replica_id.unique_id, pending_request.metadata.internal_request_id,
                             route_hint(pending_request),
                             getattr(pending_request.routing_context, "kvfleet_cached", 0))

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self.state.on_completed(replica_id.unique_id, internal_request_id)

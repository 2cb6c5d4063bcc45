"""What one Serve request router knows and decides, free of Serve: the replicas (by Serve replica id), their
load (routing stats plus this router's own requests), the exact PrefixIndex fed by KV event subscriptions, the
ApproxPrefixIndex, the session ring - and `choose`, which asks kvfleet's policy object (router/routing/policies/) for a
replica, exactly as the HTTP router's Fleet.route does. request_router.py adapts it to Serve's RequestRouter.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field

from deploy.ray.kv_subscription import ReplicaKVSubscription
from deploy.ray.route_hint import RouteHint
from router.config import ScoringConfig
from router.routing.approx_index import ApproxPrefixIndex
from router.routing.policies import POLICIES, Decision, HashRing, IndexKind, Policy, ReplicaView, RouteRequest
from router.routing.prefix_index import PrefixIndex
from router.routing.states import KVEventsState

NO_HINT = RouteHint()

# Every RoutingState of this process, so that the ingress can end their KV event subscriptions when it shuts
# down (close_all): a subscription is an ongoing request on its engine replica, and Serve drains those
# before stopping a replica.
_LIVE: weakref.WeakSet[RoutingState] = weakref.WeakSet()


def close_all() -> None:
    for state in list(_LIVE):
        state.close()


@dataclass
class ReplicaLoad:
    """What this router knows about one replica's load beyond its last routing stats."""

    kv_events: KVEventsState = KVEventsState.CONNECTING
    stats: Mapping | None = None  # the last record_routing_stats seen (a new object marks a new report)
    stats_seen_at: float = 0.0
    sent: dict[str, tuple[float, int]] = field(default_factory=dict)  # request id -> (sent at, uncached tokens)
    finished_since_stats: int = 0

    def view(self, key: str, now: float, stale_s: float, cached_tokens: int) -> ReplicaView:
        """A pure view for the policy (as router/routing/replicas.py ReplicaState.view)."""
        s = self.stats or {}
        known = bool(s) and now - self.stats_seen_at <= stale_s
        new = [tokens for at, tokens in self.sent.values() if at > self.stats_seen_at]
        return ReplicaView(url=key, routable=True, load_known=known,
                           kv_usage=float(s.get("kv_usage", 0.0)) if known else 0.0,
                           kv_tokens=float(s.get("kv_tokens", 0.0)) if known else 0.0,
                           running=int(s.get("running", 0)) if known else 0,
                           waiting=int(s.get("waiting", 0)) if known else 0,
                           new_requests=len(new), new_tokens=sum(new), finished=self.finished_since_stats,
                           inflight=len(self.sent), cached_tokens=cached_tokens)


class RoutingState:
    def __init__(self, policy: str = "kv", scoring: Mapping | None = None, approx_max_blocks: int = 1 << 20,
                 heartbeat_timeout_s: float = 10.0, stats_stale_s: float = float("inf"), clock=time.monotonic):
        """stats_stale_s: routing stats older than this count as unknown load. Serve re-sends a replica's stats
        only when they change (they are part of its RunningReplicaInfo), so unchanged stats are current:
        the default never ages them out."""
        if policy not in POLICIES:
            raise ValueError(f"request_router_kwargs.policy: must be one of {sorted(POLICIES)}, got {policy!r}")
        self.policy: Policy = POLICIES[policy]
        self.scoring = ScoringConfig(**dict(scoring or {}))
        self.scoring.validate()
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.stats_stale_s = stats_stale_s
        self.clock = clock
        self.index = PrefixIndex()
        self.approx = ApproxPrefixIndex(approx_max_blocks)
        self.loads: dict[str, ReplicaLoad] = {}
        self.subscriptions: dict[str, tuple[ReplicaKVSubscription, asyncio.Task]] = {}
        self.ring = HashRing([], self.scoring.session_vnodes)
        self._turn = 0
        _LIVE.add(self)

    # -- membership ----------------------------------------------------------------------------------------
    def set_replicas(self, keys: Iterable[str], open_stream: Callable[[str], AsyncIterator[bytes]]) -> None:
        """The current replica set; new ones get a KV event subscription (when the policy needs KV events),
        departed ones lose theirs and their index entries. Call from the event loop."""
        keys = list(dict.fromkeys(keys))
        for key in [k for k in self.loads if k not in keys]:
            self.loads.pop(key)
            sub = self.subscriptions.pop(key, None)
            if sub is not None:
                sub[1].cancel()
            if self.index.has(key):
                self.index.drop(key)
            self.approx.drop(key)
        for key in keys:
            if key not in self.loads:
                self.loads[key] = ReplicaLoad()
                if self.policy.needs.kv_events:
                    self._subscribe(key, open_stream)
        if set(self.ring.urls) != set(keys):
            self.ring = HashRing(keys, self.scoring.session_vnodes)

    def _subscribe(self, key: str, open_stream: Callable[[str], AsyncIterator[bytes]]) -> None:
        def on_status(status: KVEventsState) -> None:
            if key in self.loads:
                self.loads[key].kv_events = status

        sub = ReplicaKVSubscription(key, lambda: open_stream(key), self.index, self.heartbeat_timeout_s, on_status)
        self.subscriptions[key] = (sub, asyncio.get_running_loop().create_task(sub.run()))

    def close(self) -> None:
        """End every subscription (thread-safe: Serve runs request routers on their own event loop)."""
        for _, task in self.subscriptions.values():
            if not task.get_loop().is_closed():
                task.get_loop().call_soon_threadsafe(task.cancel)
        self.subscriptions.clear()

    def on_stats(self, key: str, stats: Mapping | None) -> None:
        """The replica's routing stats as Serve has them now (the same object until a new report)."""
        load = self.loads.get(key)
        if load is not None and stats and stats is not load.stats:
            load.stats, load.stats_seen_at, load.finished_since_stats = stats, self.clock(), 0

    # -- routing -------------------------------------------------------------------------------------------
    def predict_cached(self, hint: RouteHint, keys: list[str]) -> dict[str, int]:
        """Per replica, the prompt tokens its prefix cache holds (exact index, or approximate fallback)."""
        if not hint.block_hashes:
            return {}
        needs, out = self.policy.needs, {}
        exact = [k for k in keys if needs.index_for(self.loads[k].kv_events) is IndexKind.EXACT
                 and self.index.params.get(k) == (hint.block_size, hint.hash_seed)]
        approx = [k for k in keys if needs.index_for(self.loads[k].kv_events) is IndexKind.APPROX]
        for k, n in self.index.matched_blocks(hint.block_hashes, exact).items():
            out[k] = n * hint.block_size
        for k, n in self.approx.matched_blocks(hint.block_hashes, approx).items():
            out[k] = n * hint.block_size
        return out

    def choose(self, keys: list[str], hint: RouteHint | None) -> Decision | None:
        """The policy's replica for the request among `keys` (known replicas only), or None."""
        keys = [k for k in keys if k in self.loads]
        if not keys:
            return None
        hint = hint or NO_HINT
        now = self.clock()
        cached = self.predict_cached(hint, keys)
        views = [self.loads[k].view(k, now, self.stats_stale_s, cached.get(k, 0)) for k in keys]
        self._turn += 1
        return self.policy.choose(views, RouteRequest(hint.num_prompt_tokens, hint.session_key), self.scoring,
                                  self.ring, self._turn - 1)

    # -- request lifecycle ---------------------------------------------------------------------------------
    def on_routed(self, key: str, request_id: str, hint: RouteHint | None, predicted_cached: int) -> None:
        load = self.loads.get(key)
        if load is None:
            return
        hint = hint or NO_HINT
        load.sent[request_id] = (self.clock(), max(hint.num_prompt_tokens - predicted_cached, 0))
        if hint.block_hashes and self.policy.needs.index_for(load.kv_events) is IndexKind.APPROX:
            self.approx.record(key, hint.block_hashes)  # where it went

    def on_completed(self, key: str, request_id: str) -> None:
        load = self.loads.get(key)
        if load is not None and load.sent.pop(request_id, None) is not None:
            load.finished_since_stats += 1

"""What one Serve request router knows and decides, free of Serve: the Serve replica ids as the members of the
placement core (router/routing/placement.py: both prefix indexes, replica views, `policy.choose`, what was
routed - the HTTP router's own core), fed with the replicas' routing stats and their KV event subscriptions,
and the request ids of what this router has in flight. request_router.py adapts it to Serve's RequestRouter.

Serve reports no first token to a request router, so a request counts as pending prefill on its replica
until it completes (as the HTTP router counts a request that is not streamed).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Mapping

from contract.hashing import DEFAULT_HASH_SEED
from deploy.ray.kv_subscription import ReplicaKVSubscription
from deploy.ray.route_hint import RouteHint
from router.config import ScoringConfig
from router.routing.placement import DEFAULT_POOL, HashedPrompt, Placement, PlacementConfig
from router.routing.policies import POLICIES, Decision, Policy
from router.routing.replicas import EngineLoad, ReplicaState, Ticket
from router.states import KVEventsState

NO_HINT = RouteHint()

# Every RoutingState of this process, so that the ingress can end their KV event subscriptions when it shuts
# down (close_all): a subscription is an ongoing request on its engine replica, and Serve drains those
# before stopping a replica.
_LIVE: weakref.WeakSet[RoutingState] = weakref.WeakSet()


def close_all() -> None:
    for state in list(_LIVE):
        state.close()


def prompt_of(hint: RouteHint | None) -> HashedPrompt:
    hint = hint or NO_HINT
    return HashedPrompt(hint.num_prompt_tokens, hint.session_key, hint.block_size, hint.hash_seed, hint.block_hashes)


def load_of(stats: Mapping) -> EngineLoad:
    """A replica's routing stats (engine_replica.py record_routing_stats) as the load the core reads."""
    kv_usage, kv_tokens = float(stats.get("kv_usage", 0.0)), float(stats.get("kv_tokens", 0.0))
    capacity = stats.get("kv_capacity_tokens")
    if capacity is None:  # stats of an engine replica from before kv_capacity_tokens
        capacity = kv_tokens / kv_usage if kv_usage > 0 else 0.0
    return EngineLoad(kv_usage=kv_usage, running=int(stats.get("running", 0)), waiting=int(stats.get("waiting", 0)),
                      kv_capacity_tokens=float(capacity))


class RoutingState:
    def __init__(self, policy: str = "kv", scoring: Mapping | None = None, approx_max_blocks: int = 1 << 20,
                 heartbeat_timeout_s: float = 10.0, stats_stale_s: float = float("inf"),
                 block_size: int = 16, hash_seed: int = DEFAULT_HASH_SEED, clock=time.monotonic):
        """stats_stale_s: routing stats older than this count as unknown load. Serve re-sends a replica's stats
        only when they change (they are part of its RunningReplicaInfo), so unchanged stats are current:
        the default never ages them out. block_size, hash_seed: the engines' (the ingress hashes prompts
        with them); the approximate index keeps hashes made with these."""
        if policy not in POLICIES:
            raise ValueError(f"request_router_kwargs.policy: must be one of {sorted(POLICIES)}, got {policy!r}")
        self.policy: Policy = POLICIES[policy]
        self.scoring = ScoringConfig(**dict(scoring or {}))
        self.scoring.validate()
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.stats_stale_s = stats_stale_s
        self.clock = clock
        # grace 0: a request sent before this router saw a replica's stats is taken as counted by them
        self.placement = Placement(self.policy, PlacementConfig(self.scoring, block_size, hash_seed, approx_max_blocks,
                                                                stats_stale_s, grace_s=0.0))
        self.index = self.placement.index
        self.replicas: dict[str, ReplicaState] = self.placement.replicas
        self.subscriptions: dict[str, tuple[ReplicaKVSubscription, asyncio.Task]] = {}
        self.sent: dict[str, tuple[str, Ticket]] = {}  # request id -> (replica, its ticket)
        self._stats: dict[str, Mapping] = {}  # the last routing stats seen (a new object marks a new report)
        _LIVE.add(self)

    # -- membership ----------------------------------------------------------------------------------------
    def set_replicas(self, keys: Iterable[str], open_stream: Callable[[str], AsyncIterator[bytes]]) -> None:
        """The current replica set; new ones get a KV event subscription (when the policy needs KV events),
        departed ones lose theirs and their index entries. Call from the event loop."""
        change = self.placement.set_members(DEFAULT_POOL, keys)
        if change.left:
            self.sent = {rid: (key, t) for rid, (key, t) in self.sent.items() if key not in change.left}
        for key in change.left:
            self._stats.pop(key, None)
            sub = self.subscriptions.pop(key, None)
            if sub is not None:
                sub[1].cancel()
        for key in change.joined:
            self.placement.on_health(key, True, self.clock())  # Serve routes only to replicas it deems healthy
            if self.policy.needs.kv_events:
                self._subscribe(key, open_stream)

    def _subscribe(self, key: str, open_stream: Callable[[str], AsyncIterator[bytes]]) -> None:
        def on_status(status: KVEventsState) -> None:
            self.placement.on_kv_events(key, status)

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
        if key in self.replicas and stats and stats is not self._stats.get(key):
            self._stats[key] = stats
            now = self.clock()
            self.placement.on_load(key, load_of(stats), now, now)

    # -- routing -------------------------------------------------------------------------------------------
    def predict_cached(self, hint: RouteHint, keys: list[str]) -> dict[str, int]:
        """Per replica, the prompt tokens its prefix cache holds (exact index, or approximate fallback)."""
        return self.placement.predict_cached(prompt_of(hint), [k for k in keys if k in self.replicas])

    def choose(self, keys: list[str], hint: RouteHint | None) -> Decision | None:
        """The policy's replica for the request among `keys` (known replicas only), or None."""
        return self.placement.choose(prompt_of(hint), self.clock(), candidates=keys)

    # -- request lifecycle ---------------------------------------------------------------------------------
    def on_routed(self, key: str, request_id: str, hint: RouteHint | None, predicted_cached: int) -> None:
        ticket = self.placement.on_routed(key, prompt_of(hint), predicted_cached, self.clock())
        if ticket is not None:
            self.sent[request_id] = (key, ticket)

    def on_completed(self, key: str, request_id: str) -> None:
        sent = self.sent.pop(request_id, None)
        if sent is not None:
            self.placement.on_done(*sent)

"""The routing policy interface: what a policy reads (pure views of the fleet and the request), what it
returns (a Decision), what the router must feed it (PolicyNeeds), and `Policy` itself.

Views are snapshots taken by the caller (the live router's Fleet, a fleet simulator, a Ray Serve request
router); a policy does no I/O, keeps no state and reads no clock, so the same object serves all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from router.states import KVEventsState, StrEnum

if TYPE_CHECKING:
    from router.config import ScoringConfig
    from router.routing.policies.ring import HashRing


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What the router knows about one replica when it routes one request."""

    url: str
    routable: bool = True  # ready, circuit not open, not already tried for this request
    load_known: bool = True  # the last /metrics scrape is fresh
    kv_usage: float = 0.0
    kv_tokens: float = 0.0  # KV cache tokens held by running requests (kv_usage * capacity; 0 if unknown)
    running: int = 0
    waiting: int = 0
    new_requests: int = 0  # sent by this router since the last scrape, still in flight
    new_tokens: int = 0  # their uncached prompt tokens
    finished: int = 0  # this router's requests counted by the last scrape that have finished since
    inflight: int = 0  # all of this router's in-flight requests on the replica
    pending: int = 0  # of those, the ones that have not streamed a token yet (prefill queued or running)
    pending_tokens: int = 0  # their uncached prompt tokens: the prefill this router knows is ahead there
    # for a request with a TTFT target: the part of that prefill due before it (targets not yet past), as the engine
    # serves prompts earliest due first (engine/scheduler.py); None for a request without one
    due_ahead_tokens: int | None = None
    prefill_rate: float = 0.0  # uncached prompt tokens/s this router has lately been sending there
    cached_tokens: int = 0  # predicted prefix-cache hit for this request
    adapter_missing: bool = False  # the request names a LoRA adapter this replica does not list (loaded on demand)
    adapter_slots_full: bool = False  # every LoRA slot there runs another adapter (vllm:lora_requests_info)
    peer_cached_tokens: int = 0  # the most of the prompt another ready replica holds (a pull's source)
    tier_tokens: int = 0  # prompt tokens past cached_tokens its lower tier holds (a reload, not a prefill)
    peer_wait_tokens: int = 0  # the prefill ahead on that replica when its copy is on the way (still computing)
    peer_on_the_way: bool = False  # that replica's copy is on the way: routed there, not yet in its KV events
    pulling_from: str | None = None  # this replica's copy of the prompt is a pull from that peer, still on its way
    pulling_pending: bool = False  # and that peer's own copy is on its way too (still computing)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    num_prompt_tokens: int = 0
    session_key: str | None = None


class Reason(StrEnum):
    """Why a replica was chosen (the `reason` label of the routing-decision metric)."""

    CACHE = "cache"
    ADAPTER = "adapter"  # the request's LoRA adapter is there (and no prefix of it elsewhere outweighs that)
    SESSION = "session"
    LEAST_LOAD = "least-load"
    ROUND_ROBIN = "round-robin"
    ALL_OVERLOADED = "all-overloaded"


@dataclass(frozen=True, slots=True)
class Decision:
    url: str
    reason: Reason
    predicted_cached_tokens: int  # its own cached prefix, plus what it pulls
    cost: float
    pull_tokens: int = 0  # prompt tokens past its own cached prefix to pull from a peer (0: none)
    pull_from: str | None = None  # that peer (Placement.choose names it)
    pull_pending: bool = False  # the peer is still computing it (its copy is on the way): the pull may wait for it
    prefill: float | None = None  # the prompt's work there in prefill tokens (load.prefill_tokens): what the TTFT model takes


class IndexKind(StrEnum):
    """Where a replica's predicted cache hit comes from."""

    EXACT = "exact"  # mirrored from the replica's KV event stream
    APPROX = "approx"  # where this router sent earlier prompts


@dataclass(frozen=True, slots=True)
class PolicyNeeds:
    """What the router must compute before calling `choose`.

    kv_events: subscribe to each replica's KV events and predict hits from the exact index where it is live.
    approx_index: predict hits from the approximate index - for every replica, or, with kv_events, for
    replicas that have no KV event endpoint.
    """

    kv_events: bool = False
    approx_index: bool = False

    @property
    def prompt_tokens(self) -> bool:
        """Tokenize and hash each prompt (any cache prediction needs its block hashes)."""
        return self.kv_events or self.approx_index

    def index_for(self, kv_events: KVEventsState) -> IndexKind | None:
        """The index that predicts a replica's hits, given its KV event stream; None: no prediction (the
        policy ignores caches, or the replica's stream is still connecting)."""
        if self.kv_events and kv_events is KVEventsState.LIVE:
            return IndexKind.EXACT
        if self.approx_index and (not self.kv_events or kv_events is KVEventsState.UNAVAILABLE):
            return IndexKind.APPROX
        return None


class Policy(Protocol):
    """A routing policy: one replica out of `views` for `req`, or None when no replica is routable.

    `ring` is the session hash ring over the current replica set (rebuilt by the caller when it changes);
    `turn` is a counter the caller advances once per decision: it rotates ties so equal replicas share
    sequential traffic, and drives round-robin."""

    @property
    def name(self) -> str: ...

    @property
    def needs(self) -> PolicyNeeds: ...

    def choose(self, views: Sequence[ReplicaView], req: RouteRequest, cfg: ScoringConfig, ring: HashRing,
               turn: int) -> Decision | None: ...

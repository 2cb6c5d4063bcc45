"""The router side of the fleet simulator: the placement core the HTTP router and the Ray request router drive
(router/routing/placement.py), fed as the live router feeds it - a load reading per scrape, each engine's KV
events through the live router's own EventApplier (a snapshot when the replica joins, then its events in
order), first tokens and finishes - and asked to place each request. Requests reach an engine the instant they
are routed (no network); the router sees the engines only through these readings and events.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from contract.kv_events import KVMessage, Snapshot
from router.config import ScoringConfig
from router.routing.kv_events import EventApplier
from router.routing.placement import DEFAULT_POOL, Placement, PlacementConfig, Prompt
from router.routing.policies import POLICIES, Decision
from router.routing.replicas import EngineLoad, Ticket
from router.states import KVEventsState

if TYPE_CHECKING:
    from kvfleet.sim.engine import SimSeq

SIM_HASH_SEED = 0  # the workloads' block hashes are computed beforehand; the seed only labels them


class SimRouter:
    def __init__(self, policy: str, scoring: ScoringConfig, block_size: int, hash_seed: int = SIM_HASH_SEED,
                 stale_s: float = 3.0, approx_max_blocks: int = 200_000):
        self.block_size, self.hash_seed = block_size, hash_seed
        self.placement = Placement(POLICIES[policy], PlacementConfig(scoring, block_size, hash_seed,
                                                                     approx_max_blocks, stale_s))
        self._appliers: dict[str, EventApplier] = {}

    @property
    def members(self) -> list[str]:
        """The routable replicas, in the order they joined."""
        return self.placement.members.get(DEFAULT_POOL, [])

    def join(self, url: str, t: float, kv_seq: int = 0, cached: tuple[int, ...] = ()) -> None:
        """A replica is ready: its KV events are live from a snapshot (`cached` as of event `kv_seq`)."""
        self.placement.set_members(DEFAULT_POOL, [*self.members, url])
        self.placement.on_health(url, True, t)
        self.placement.on_kv_events(url, KVEventsState.LIVE)
        self._appliers[url] = EventApplier(url, self.placement.index)
        self._appliers[url].apply(Snapshot(kv_seq, self.block_size, self.hash_seed, cached))

    def leave(self, url: str) -> None:
        """Nothing new goes to the replica; the router forgets its blocks (its requests still finish)."""
        self.placement.set_members(DEFAULT_POOL, [u for u in self.members if u != url])
        self._appliers.pop(url, None)

    def on_scrape(self, url: str, load: EngineLoad, t: float) -> None:
        self.placement.on_load(url, load, t, t)

    def on_kv_events(self, url: str, messages: Iterable[KVMessage]) -> bool:
        """The replica's events since the last call; False when one is missing (then send a snapshot)."""
        applier = self._appliers.get(url)
        return applier is None or all(applier.apply(m) for m in messages)

    def route(self, prompt: Prompt, t: float) -> tuple[Decision, Ticket]:
        d = self.placement.choose(prompt, t)
        if d is None:
            raise RuntimeError("no routable replica")  # the simulator always has one
        ticket = self.placement.on_routed(d.url, prompt, d.predicted_cached_tokens, t, prefill=d.prefill)
        assert ticket is not None  # the chosen replica is a member
        return d, ticket

    def on_first_token(self, url: str, ticket: Ticket, now: float | None = None) -> None:
        """With `now`, the router's TTFT model learns from it, as the live router's does."""
        self.placement.on_first_token(url, ticket, now)

    def on_done(self, url: str, ticket: Ticket, seq: SimSeq | None = None) -> None:
        """With the finished sequence, the router's TPOT model learns from its tokens after the first, as the
        live router's does from a stream's usage."""
        if seq is not None and seq.done_s is not None:
            self.placement.on_decoded(ticket, seq.output, seq.done_s)
        self.placement.on_done(url, ticket)

"""A simulated engine's lower KV tier, as the engine keeps one (engine/kv/tier.py, engine/kv/offload.py): host
memory beside a GPU, local disk beside a CPU engine.

A cached block the pool evicts is copied to the tier (the pool's `on_evict`) and announced there: a `stored` event
with the tier's medium; blocks the tier lets go to make room (least recently used first) a `removed` one with it.
The tier is inclusive, as the engine's: a block reloaded into the pool stays in the tier, as its most recently
used. SimEngine reloads, at admission, the run of a prompt's blocks the tier holds right after the pool's own
hit: they get pool blocks, enter the prefix cache (a `stored` event without a medium) and count as hits.

The router sees tier blocks as the live router does (router/routing/prefix_index.py `tier_run`): past a
replica's cached prefix, the tokens its tier holds cost their reload (ScoringConfig.tier_token_cost, here derived
from the tier's bandwidth as the pull cost is from the pull link's), not a prefill.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from engine.kv.events import KVEventLog
from kvfleet.sim.cost import CostModel
from kvfleet.sim.link import PullLink
from router.config import ScoringConfig

MEDIUM = "DISK"  # what the events name the tier (the calibrated engine is a CPU one: its tier is local disk)


@dataclass(frozen=True)
class TierSpec:
    """A tier of `factor` x the pool's blocks, read back over `link` (default 2 GB/s, 1 ms per reload)."""

    factor: float
    link: PullLink = field(default_factory=lambda: PullLink(2e9, 0.001))

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"TierSpec.factor: must be > 0, got {self.factor}")

    def blocks(self, pool_blocks: int) -> int:
        return int(self.factor * pool_blocks)

    def scoring(self, scoring: ScoringConfig, cost: CostModel) -> ScoringConfig:
        """The routing score's reload cost per tier token, in prefill-token units of `cost` (its set-up time is
        not in the live router's score, so it is left out here too)."""
        link = self.link
        return replace(scoring, tier_token_cost=link.kv_bytes_per_token / link.bandwidth_bytes_s / cost.prefill_token_s)


class KVTier:
    """The tier's block hashes in LRU order (oldest first), at most `capacity`; announces what it keeps and drops
    in the pool's event log."""

    def __init__(self, capacity: int, events: KVEventLog):
        self.capacity = capacity
        self.events = events
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.spilled_blocks = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def hashes(self) -> list[int]:
        return list(self._lru)

    def spill(self, evicted: Sequence[tuple[int, int, tuple[int, ...], str | None]]) -> None:
        """The pool's `on_evict`: keep the evicted blocks (block id, hash, tokens, adapter), newest last."""
        if self.capacity < 1:
            return
        kept = [h for _, h, _, _ in evicted if h not in self._lru]
        dropped = self._put(h for _, h, _, _ in evicted)
        kept = [h for h in kept if h in self._lru]
        self.events.removed([h for h in dropped if h not in self._lru], MEDIUM)
        self.events.stored(kept, None, None, MEDIUM)
        self.spilled_blocks += len(kept)

    def take(self, block_hashes: Sequence[int]) -> list[int]:
        """The leading run of the chain the tier holds, each refreshed as most recently used (a reload reads
        them; they stay in the tier)."""
        n = 0
        for h in block_hashes:
            if h not in self._lru:
                break
            self._lru.move_to_end(h)
            n += 1
        return list(block_hashes[:n])

    def _put(self, block_hashes: Iterable[int]) -> list[int]:
        for h in block_hashes:
            self._lru[h] = None
            self._lru.move_to_end(h)
        dropped: list[int] = []
        while len(self._lru) > self.capacity:
            dropped.append(self._lru.popitem(last=False)[0])
        return dropped

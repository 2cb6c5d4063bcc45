"""Approximate prefix index from routing history, for replicas that publish no KV events.

After routing a request, the router records its chained block hashes for the replica it chose: that replica
has most likely cached them. Memory is bounded by an LRU over block hashes (`max_blocks` entries); the least
recently routed blocks are forgotten first, much like the engines' own LRU eviction. Pure state, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from router.routing.prefix_index import leading_matches


class ApproxPrefixIndex:
    def __init__(self, max_blocks: int):
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._lru: OrderedDict[int, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def record(self, replica: str, block_hashes: Sequence[int]) -> None:
        """The request with these blocks was routed to `replica`."""
        lru = self._lru
        for h in block_hashes:
            holders = lru.get(h)
            if holders is None:
                lru[h] = {replica}
            else:
                holders.add(replica)
                lru.move_to_end(h)
        while len(lru) > self.max_blocks:
            lru.popitem(last=False)

    def drop(self, replica: str) -> None:
        for h in [h for h, holders in self._lru.items() if replica in holders]:
            holders = self._lru[h]
            holders.discard(replica)
            if not holders:
                del self._lru[h]

    def matched_blocks(self, block_hashes: Sequence[int], replicas: Iterable[str]) -> dict[str, int]:
        """Per replica, how many leading blocks of the chain were routed to it (and not yet forgotten)."""
        return leading_matches(block_hashes, set(replicas), self._lru)

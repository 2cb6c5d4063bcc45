"""Prefixes on their way into a replica's cache: prompts routed there in the last `ttl_s` seconds.

An exact index learns a replica holds a prefix from its KV events, once the prefill ran. Until then a burst of
requests on one new prompt looks uncached everywhere: each would compute the prompt again wherever load sends it,
and a router that pulls (issue 31) would not know where to pull from. The placement counts a prompt it routed as
held by that replica for `ttl_s`: the next request stays there while its load allows (the `kv` cost), or with
pulls on goes elsewhere and pulls it, the source engine streaming the blocks as its prefill computes them
(engine/server/kv_transfer.py). Pure state, no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence


class InflightPrefixes:
    def __init__(self, ttl_s: float):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._until: dict[int, dict[str, float]] = {}  # block hash -> replica -> when it stops counting
        self._order: deque[tuple[float, str, tuple[int, ...]]] = deque()

    def __len__(self) -> int:
        return len(self._until)

    def record(self, replica: str, block_hashes: Sequence[int], now: float) -> None:
        """A request with these blocks was routed to `replica` at `now`."""
        until = now + self.ttl_s
        for h in block_hashes:
            self._until.setdefault(h, {})[replica] = until
        self._order.append((until, replica, tuple(block_hashes)))
        self._expire(now)

    def drop(self, replica: str) -> None:
        for h in [h for h, holders in self._until.items() if replica in holders]:
            holders = self._until[h]
            del holders[replica]
            if not holders:
                del self._until[h]

    def matched_blocks(self, block_hashes: Sequence[int], replicas: Iterable[str], now: float) -> dict[str, int]:
        """Per replica, how many leading blocks of the chain were routed to it in the last ttl_s seconds."""
        remaining = set(replicas)
        out = dict.fromkeys(remaining, 0)
        for i, h in enumerate(block_hashes):
            holders = self._until.get(h)
            still = {r for r in remaining if holders is not None and holders.get(r, 0.0) > now}
            for r in remaining - still:
                out[r] = i
            remaining = still
            if not remaining:
                return out
        for r in remaining:
            out[r] = len(block_hashes)
        return out

    def _expire(self, now: float) -> None:
        order = self._order
        while order and order[0][0] <= now:
            _, replica, hashes = order.popleft()
            for h in hashes:
                holders = self._until.get(h)
                if holders is not None and holders.get(replica, now + 1) <= now:
                    del holders[replica]
                    if not holders:
                        del self._until[h]

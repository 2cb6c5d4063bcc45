"""Prefixes on their way into a replica's cache: prompts routed there in the last `ttl_s` seconds.

An exact index learns a replica holds a prefix from its KV events, once the prefill ran. Until then a burst of
requests on one new prompt looks uncached everywhere: each would compute the prompt again wherever load sends it,
and a router that pulls (issue 31) would not know where to pull from. The placement counts a prompt it routed as
held by that replica for `ttl_s`: the next request stays there while its load allows (the `kv` cost), or with
pulls on goes elsewhere and pulls it, the source engine streaming the blocks as its prefill computes them
(engine/server/kv_transfer.py). A copy on its way by a pull remembers its source, so that the burst's next
requests there carry the same pull: whichever reaches the engine first starts it and the others join it, where
one that overtook the pull on the way would compute the whole prompt. Pure state, no I/O.
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
        self._source: dict[int, dict[str, str]] = {}  # block hash -> replica -> the peer it was sent to pull from

    def __len__(self) -> int:
        return len(self._until)

    def record(self, replica: str, block_hashes: Sequence[int], now: float, pull_from: str | None = None) -> None:
        """A request with these blocks was routed to `replica` at `now`; `pull_from`: to pull them from that peer
        (a copy on its way already keeps its source; the blocks past it are computed there)."""
        until = now + self.ttl_s
        for h in block_hashes:
            holders = self._until.setdefault(h, {})
            if pull_from is not None:
                self._source.setdefault(h, {})[replica] = pull_from
            elif holders.get(replica, 0.0) <= now and (sources := self._source.get(h)) is not None:
                sources.pop(replica, None)  # computed there this time
            holders[replica] = until
        self._order.append((until, replica, tuple(block_hashes)))
        self._expire(now)

    def pulling_from(self, replica: str, block_hash: int, now: float) -> str | None:
        """The peer `replica` was sent to pull this block from, while that copy counts as on its way."""
        if self._until.get(block_hash, {}).get(replica, 0.0) <= now:
            return None
        return self._source.get(block_hash, {}).get(replica)

    def drop(self, replica: str) -> None:
        for h in [h for h, holders in self._until.items() if replica in holders]:
            self._forget(h, replica)
        for h in [h for h, sources in self._source.items() if replica in sources.values()]:
            self._source[h] = {r: s for r, s in self._source[h].items() if s != replica}
            if not self._source[h]:
                del self._source[h]

    def _forget(self, h: int, replica: str) -> None:
        holders = self._until[h]
        del holders[replica]
        if not holders:
            del self._until[h]
        sources = self._source.get(h)
        if sources is not None and sources.pop(replica, None) is not None and not sources:
            del self._source[h]

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
                    self._forget(h, replica)

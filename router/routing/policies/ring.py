"""Consistent hashing with bounded load, for session affinity."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence

import xxhash

from router.routing.policies.base import ReplicaView
from router.routing.policies.load import Load


def _h64(data: str) -> int:
    return xxhash.xxh3_64_intdigest(data.encode("utf-8"))


class HashRing:
    """Consistent hashing with bounded load (Mirrokni et al.): walk clockwise from the key's point and take
    the first eligible replica whose load is under ceil(c * (total + 1) / n). Adding or removing a replica
    moves only the keys whose walk meets it. Immutable once built; rebuild when the replica set changes."""

    def __init__(self, urls: Sequence[str], vnodes: int = 64):
        self.urls = tuple(sorted(set(urls)))
        points = sorted((_h64(f"{url}#{k}"), url) for url in self.urls for k in range(vnodes))
        self._keys = [p for p, _ in points]
        self._owners = [u for _, u in points]

    def walk(self, key: str) -> Iterator[str]:
        """Replica URLs in the order the key's walk meets them (each once)."""
        if not self._keys:
            return
        start = bisect.bisect(self._keys, _h64(key))
        seen: set[str] = set()
        n = len(self._keys)
        for k in range(n):
            url = self._owners[(start + k) % n]
            if url not in seen:
                seen.add(url)
                yield url
                if len(seen) == len(self.urls):
                    return

    def choose(self, key: str, views: Sequence[ReplicaView], loads: list[Load], idx: list[int],
               load_factor: float) -> int:
        by_url = {views[i].url: i for i in idx}
        total = sum(loads[i].queued for i in idx)
        capacity = math.ceil(load_factor * (total + 1) / len(idx))
        first = None
        for url in self.walk(key):
            i = by_url.get(url)
            if i is None:
                continue
            if first is None:
                first = i
            if loads[i].queued < capacity:
                return i
        if first is not None:
            return first
        return min(idx, key=lambda i: (loads[i].queued, i))  # replicas the ring does not know yet

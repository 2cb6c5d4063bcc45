"""Exact prefix index built from the replicas' KV events: which replica's prefix cache holds which block.

One dict maps a block hash to the replicas holding it, so a lookup walks the request's chained block hashes
once for the whole fleet. Chained hashes make "block i cached" imply "its whole prefix was the same", so the
longest cached prefix of a replica is the run of leading hashes it holds. Pure state, no I/O: the KV event
subscriber (kv_events.py) feeds it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from contract.cacheable import cacheable_blocks
from contract.hashing import hash_blocks


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._blocks: dict[str, set[int]] = {}
        self.params: dict[str, tuple[int, int]] = {}  # replica → (block_size, hash_seed) from its snapshot
        self._tier: dict[str, set[int]] = {}  # replica → blocks its lower tier holds (events with a medium)

    # -- updates (from KV events) --------------------------------------------------------------------------
    def reset(self, replica: str, block_hashes: Iterable[int], block_size: int, hash_seed: int,
              tier_hashes: Iterable[int] = ()) -> None:
        """A snapshot: the replica holds exactly these blocks (and its lower tier those)."""
        self.drop(replica)
        self.params[replica] = (block_size, hash_seed)
        self.store(replica, block_hashes)
        self.store(replica, tier_hashes, "tier")

    def store(self, replica: str, block_hashes: Iterable[int], medium: str | None = None) -> None:
        if medium is not None:
            self._tier.setdefault(replica, set()).update(block_hashes)
            return
        mine = self._blocks.setdefault(replica, set())
        for h in block_hashes:
            if h not in mine:
                mine.add(h)
                self._holders.setdefault(h, set()).add(replica)

    def remove(self, replica: str, block_hashes: Iterable[int], medium: str | None = None) -> None:
        if medium is not None:
            self._tier.get(replica, set()).difference_update(block_hashes)
            return
        mine = self._blocks.get(replica)
        if mine is None:
            return
        for h in block_hashes:
            if h in mine:
                mine.discard(h)
                self._discard_holder(h, replica)

    def clear(self, replica: str) -> None:
        """The replica's cache was cleared (it stays known, with its parameters)."""
        for h in self._blocks.pop(replica, ()):
            self._discard_holder(h, replica)
        self._blocks[replica] = set()
        self._tier.pop(replica, None)

    def drop(self, replica: str) -> None:
        """Forget the replica entirely (it left the fleet or its event stream broke)."""
        self.clear(replica)
        del self._blocks[replica]
        self.params.pop(replica, None)

    def _discard_holder(self, h: int, replica: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[h]

    # -- queries -------------------------------------------------------------------------------------------
    def has(self, replica: str) -> bool:
        return replica in self._blocks

    def num_blocks(self, replica: str) -> int:
        return len(self._blocks.get(replica, ()))

    def matched_blocks(self, block_hashes: Sequence[int], replicas: Iterable[str]) -> dict[str, int]:
        """Per replica, how many leading blocks of the chain it holds."""
        return leading_matches(block_hashes, {r for r in replicas if r in self._blocks}, self._holders)

    def tier_run(self, block_hashes: Sequence[int], replica: str, start: int) -> int:
        """How many blocks of the chain from `start` on the replica's lower tier holds (it reloads them)."""
        tier = self._tier.get(replica)
        if not tier:
            return 0
        n = 0
        for h in block_hashes[start:]:
            if h not in tier:
                break
            n += 1
        return n


def leading_matches(block_hashes: Sequence[int], replicas: set[str],
                    holders_of: Mapping[int, set[str]]) -> dict[str, int]:
    """Per replica, how many leading blocks of the chain holders_of says it holds."""
    remaining = set(replicas)
    out = dict.fromkeys(remaining, 0)
    matched = 0
    for h in block_hashes:
        if not remaining:
            break
        holders = holders_of.get(h)
        still = remaining & holders if holders else set()
        for r in remaining - still:
            out[r] = matched
        remaining = still
        matched += 1
    for r in remaining:
        out[r] = matched
    return out


def request_block_hashes(token_ids: Sequence[int], block_size: int, hash_seed: int,
                         cache_salt: str | None, adapter: str | None = None) -> list[int]:
    """The chained hashes of the blocks a prefix hit could cover, exactly as the engines compute them (adapter:
    the request's LoRA adapter, part of the first block's hash)."""
    n = cacheable_blocks(len(token_ids), block_size)
    return hash_blocks(token_ids[: n * block_size], block_size, cache_salt, hash_seed, adapter=adapter)

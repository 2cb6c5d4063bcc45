"""Pinned KV blocks: prefixes a client marked with `cache_control` (contract/cache_control.py; a request's
engine/cache_pin.py CachePin), kept from eviction for a while.

    pins = PinTable(pool, max_blocks, max_blocks_per_tenant)
    pins.reserve(key, tenant, n, alive)    # at admission: room for n more pinned blocks, or PinLimitError
    pins.pin(key, blocks, tenant, ttl_s, now)   # once they are computed and cached: one reference each
    pins.refresh(blocks, now)              # a request read them: their TTL starts again
    pins.expire(now)                       # every step: references of expired pins dropped (tail first)

A pinned block holds one reference of the pin table, so the pool never evicts it and no `removed` event is sent
for it; when its TTL passes the reference is dropped and it is an ordinary cached block again (LRU, and the lower
tier when evicted, as any other). A block is owned by the tenant that pinned it first; a later pin of the same
block by anyone refreshes it and costs nothing. At most `max_blocks` blocks are pinned (the rest of the pool stays
for running requests: pinning never starves allocation), at most `max_blocks_per_tenant` per tenant; a request
asks for its blocks at admission (`reserve`), so one beyond a limit is refused before it holds anything, and a
reservation ends when the request pins or finishes (`alive()` false). Pure: time is passed in.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engine.errors import PinLimitError
from engine.kv.block_pool import BlockPool, KVCacheBlock


@dataclass
class _Pin:
    expiry: float
    ttl_s: float
    tenant: str


@dataclass
class _Reservation:
    tenant: str
    blocks: int
    alive: Callable[[], bool]


class PinTable:
    def __init__(self, pool: BlockPool, max_blocks: int, max_blocks_per_tenant: int):
        if max_blocks < 0 or max_blocks_per_tenant < 0:
            raise ValueError(f"pin limits must be >= 0, got {max_blocks}, {max_blocks_per_tenant}")
        if max_blocks >= pool.num_blocks > 0:
            raise ValueError(f"max_blocks ({max_blocks}) must leave blocks to allocate ({pool.num_blocks} in all)")
        self.pool = pool
        self.max_blocks = max_blocks
        self.max_blocks_per_tenant = min(max_blocks_per_tenant, max_blocks)
        self._pins: dict[int, _Pin] = {}  # block id -> its pin, in pinning order
        self._reserved: dict[object, _Reservation] = {}
        self._owned: Counter[str] = Counter()  # tenant -> blocks pinned

    @property
    def enabled(self) -> bool:
        return self.max_blocks > 0

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def pinned_by(self, tenant: str) -> int:
        return self._owned[tenant]

    def block_ids(self) -> list[int]:
        return list(self._pins)

    def is_pinned(self, block: KVCacheBlock) -> bool:
        return block.block_id in self._pins

    def num_reserved(self) -> int:
        self._purge()
        return sum(r.blocks for r in self._reserved.values())

    # ---- admission -------------------------------------------------------------------------

    def reserve(self, key: object, tenant: str, blocks: int, alive: Callable[[], bool]) -> None:
        """Hold room for `blocks` more pinned blocks of `tenant` until `key` pins (or `alive()` turns false);
        PinLimitError (and nothing held) beyond a limit."""
        if blocks <= 0:
            return
        self._purge()
        total = self.num_pinned + sum(r.blocks for r in self._reserved.values())
        mine = self._owned[tenant] + sum(r.blocks for r in self._reserved.values() if r.tenant == tenant)
        who = f"tenant {tenant!r}" if tenant else "requests without a tenant"
        if mine + blocks > self.max_blocks_per_tenant:
            raise PinLimitError(f"the cache_control prefix needs {blocks} more pinned KV blocks, but {who} already "
                                f"pin(s) or are pinning {mine} of the {self.max_blocks_per_tenant} allowed per tenant; "
                                f"retry when earlier pins expire, or mark a shorter prefix")
        if total + blocks > self.max_blocks:
            raise PinLimitError(f"the cache_control prefix needs {blocks} more pinned KV blocks, but {total} of this "
                                f"engine's {self.max_blocks} are pinned or being pinned; retry later or elsewhere")
        self._reserved[key] = _Reservation(tenant, blocks, alive)

    def release(self, key: object) -> None:
        self._reserved.pop(key, None)

    # ---- pins ------------------------------------------------------------------------------

    def pin(self, key: object, blocks: Iterable[KVCacheBlock], tenant: str, ttl_s: float, now: float) -> int:
        """Pin a chain's leading blocks (cached, in chain order) until now + ttl_s; those pinned already get the
        later expiry and the longer TTL. Stops at the first block the limits leave no room for (the reservation's
        room is this request's). Ends the reservation of `key`; returns the blocks newly pinned."""
        res = self._reserved.pop(key, None)
        room = res.blocks if res is not None else 0
        others = sum(r.blocks for r in self._reserved.values())
        others_mine = sum(r.blocks for r in self._reserved.values() if r.tenant == tenant)
        added = 0
        for block in blocks:
            pin = self._pins.get(block.block_id)
            if pin is not None:
                pin.expiry = max(pin.expiry, now + ttl_s)
                pin.ttl_s = max(pin.ttl_s, ttl_s)
                continue
            if block.block_hash is None:
                break  # not cached: nothing could ever hit it
            if added >= room and (self.num_pinned + others >= self.max_blocks
                                  or self._owned[tenant] + others_mine >= self.max_blocks_per_tenant):
                break
            self.pool.touch([block])
            self._pins[block.block_id] = _Pin(now + ttl_s, ttl_s, tenant)
            self._owned[tenant] += 1
            added += 1
        return added

    def refresh(self, blocks: Iterable[KVCacheBlock], now: float) -> None:
        """A request read these blocks: each pinned one lives its TTL again from now."""
        for block in blocks:
            pin = self._pins.get(block.block_id)
            if pin is not None:
                pin.expiry = max(pin.expiry, now + pin.ttl_s)

    def expire(self, now: float) -> int:
        """Unpin every block whose TTL has passed (newest pins first, so a chain's tail goes to the LRU queue
        before its head and is evicted first); ends the reservations of finished requests. How many."""
        self._purge()
        gone = [bid for bid, pin in self._pins.items() if pin.expiry <= now]
        self._unpin(gone)
        return len(gone)

    def unpin_all(self) -> int:
        gone = list(self._pins)
        self._unpin(gone)
        return len(gone)

    def _unpin(self, block_ids: list[int]) -> None:
        for bid in block_ids:
            self._owned[self._pins.pop(bid).tenant] -= 1
        self.pool.free_blocks(self.pool.blocks[bid] for bid in reversed(block_ids))
        for tenant in [t for t, n in self._owned.items() if n == 0]:
            del self._owned[tenant]

    def _purge(self) -> None:
        for key in [k for k, r in self._reserved.items() if not r.alive()]:
            del self._reserved[key]

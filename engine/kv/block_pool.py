"""The physical KV blocks: reference counts, an LRU free queue, and the hash → block prefix-cache map.

A block with ref_cnt 0 sits in the free queue. Blocks that carry a prefix-cache hash keep it while
free (lazy eviction): a later request can take them back from the middle of the queue in O(1),
and the hash is dropped only when the block is handed out for new content (an eviction). Freed
blocks with a hash join the tail (most recently used); freed blocks without one join the head,
since nothing can ever reuse their contents. Callers free a sequence's blocks tail-first, so the
end of a hash chain is evicted before its start.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from engine.kv.events import KVEventLog


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "lora_name", "origin", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None  # set while the block is in the prefix cache
        self.token_ids: tuple[int, ...] | None = None  # its tokens while cached (collision guard)
        self.lora_name: str | None = None  # the LoRA adapter it was computed under, while cached
        self.origin: str | None = None  # "lower_tier" | "peer": where an imported block came from, until first read
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = "-" if self.block_hash is None else f"{self.block_hash:032x}"[:8]
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """A doubly linked list of free blocks, least recently freed first; O(1) push/pop/remove."""

    def __init__(self, blocks: Iterable[KVCacheBlock]):
        self._head = KVCacheBlock(-1)  # sentinels
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        if last is None:  # the sentinels are always linked
            raise RuntimeError("free queue tail sentinel unlinked")
        self._insert_after(last, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        nxt = prev.next_free
        if nxt is None:  # only the tail sentinel has no next, and nothing goes after it
            raise ValueError(f"block {prev.block_id} is not in the free queue")
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def block_ids(self) -> list[int]:
        return [b.block_id for b in self]


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, events: KVEventLog | None = None):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVCacheBlock] = {}  # hash -> the block holding that content
        self.events = events if events is not None else KVEventLog()
        self.num_evictions = 0
        # called with (block id, hash, tokens, adapter) of the blocks an allocation evicts, while their contents
        # are still intact (engine/kv/offload.py keeps them in the lower tier); None: they are simply lost
        self.on_evict: Callable[[list[tuple[int, int, tuple[int, ...], str | None]]], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """n blocks for new content (ref_cnt 1), least recently freed first; evicts their hashes."""
        if n > self.free_queue.num_free:
            raise ValueError(f"cannot allocate {n} blocks: only {self.free_queue.num_free} free")
        out: list[KVCacheBlock] = []
        evicted: list[int] = []
        spilled: list[tuple[int, int, tuple[int, ...], str | None]] = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                if self.on_evict is not None and block.token_ids is not None:
                    spilled.append((block.block_id, block.block_hash, block.token_ids, block.lora_name))
                self._uncache(block)
            block.ref_cnt = 1
            out.append(block)
        if evicted:
            self.num_evictions += len(evicted)
            self.events.removed(evicted)
        if spilled and self.on_evict is not None:
            self.on_evict(spilled)
        return out

    def get_cached_block(self, block_hash: int, token_ids: tuple[int, ...]) -> KVCacheBlock | None:
        """The cached block with this hash whose own tokens are token_ids (collision guard), or None."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference to each block (prefix hits, forks); free ones leave the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block, in the order given (callers pass tail-first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache_blocks(self, blocks: list[KVCacheBlock], hashes: list[int], token_chunks: list[tuple[int, ...]],
                     parent_hash: int | None, lora_name: str | None = None) -> None:
        """Register consecutive full blocks of one hash chain (parent_hash precedes hashes[0]); lora_name: the
        adapter they were computed under, carried by the events.

        A hash already held by another block keeps that block; the duplicate stays uncached. One
        "stored" event is recorded per run of newly cached blocks, with the hash it chains on.
        """
        if not self.enable_caching:
            return
        run: list[int] = []
        run_parent = parent_hash
        prev = parent_hash
        for block, h, tokens in zip(blocks, hashes, token_chunks, strict=True):
            if block.block_hash is None and h not in self.cached:
                block.block_hash = h
                block.token_ids = tokens
                block.lora_name = lora_name
                self.cached[h] = block
                if not run:
                    run_parent = prev
                run.append(h)
            elif run:
                self.events.stored(run, run_parent, lora_name)
                run = []
            prev = h
        if run:
            self.events.stored(run, run_parent, lora_name)

    def uncache_adapter(self, lora_name: str) -> list[int]:
        """Forget every block computed under this LoRA adapter (blocks in use keep their content, no longer
        findable); their hashes, announced in one `removed` event."""
        gone = [h for h, block in self.cached.items() if block.lora_name == lora_name]
        for h in gone:
            self._uncache(self.cached[h])
        self.events.removed(gone)
        return gone

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only while no block is in use. Returns whether it did."""
        if self.num_used_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
            block.token_ids = None
            block.lora_name = None
            block.origin = None
        self.cached.clear()
        self.events.cleared()
        return True

    def cached_hashes(self) -> list[int]:
        return list(self.cached)

    def _uncache(self, block: KVCacheBlock) -> None:
        h = block.block_hash
        if h is not None and self.cached.get(h) is block:
            del self.cached[h]
        block.block_hash = None
        block.token_ids = None
        block.lora_name = None
        block.origin = None

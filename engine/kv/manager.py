"""The KV cache manager: block tables of sequences over the block pool, with prefix caching.

Ask/act pairs keep the scheduler's decisions free of side effects until it commits:
`get_computed_blocks(seq)` looks up the cached prefix of a new sequence (no state change), then
`allocate_slots(seq, n, computed)` either takes those blocks plus enough new ones for n more
tokens, or changes nothing and returns None. After the forward pass `cache_full_blocks(seq)`
registers the blocks that became full, hashing only those (seq.block_hashes grows incrementally).

Pins (engine/kv/pins.py): a sequence whose params carry a `cache_pin` reserves room at admission
(`reserve_pin`, PinLimitError beyond a limit) and pins the whole blocks of its marked prefix once they are cached;
a prefix hit on pinned blocks refreshes their TTL. `tick(now)` starts every step: the time pins are measured by,
and the expiry of those whose TTL has passed.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

from contract.cacheable import cacheable_blocks
from contract.hashing import hash_block
from contract.kv_events import KVEvent
from contract.usage_lookup import (
    TIERS,  # where a prefix hit's blocks came from (KVCacheBlock.origin; None: device)
)
from engine.kv.block_pool import BlockPool, KVCacheBlock
from engine.kv.config import CacheConfig
from engine.kv.events import KVEventLog
from engine.kv.pins import PinTable
from engine.sequence import Sequence


class LowerTier(Protocol):
    """What the manager asks of a lower tier (engine/kv/offload.py)."""

    def forget_adapter(self, lora_name: str) -> None: ...

    def clear(self) -> None: ...


@dataclass(frozen=True)
class KVCacheStats:
    num_total_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    usage: float
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    alloc_failures: int
    evictions: int
    preemptions: int
    pinned_blocks: int = 0


class KVCacheManager:
    def __init__(self, config: CacheConfig):
        self.config = config
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks
        self.enable_caching = config.enable_prefix_caching
        self.hash_seed = config.hash_seed
        self.events = KVEventLog(config.max_pending_kv_events)
        self.pool = BlockPool(config.num_blocks, config.enable_prefix_caching, self.events)
        self.pins = PinTable(self.pool, config.max_pinned_blocks if self.enable_caching else 0,
                             config.max_pinned_blocks_per_tenant)
        self.now = 0.0  # the time of the step being run (tick), in the clock pins expire by
        self._num_registered: dict[int, int] = {}  # seq_id -> leading blocks already in the cache
        self.lora_ids: dict[str, int] = {}  # LoRA adapter name -> the id of its current load (engine/lora/)
        self.lower: LowerTier | None = None  # engine/kv/offload.py's Offload when a lower tier keeps evicted blocks
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0
        self.alloc_failures = 0
        self.num_preemptions = 0

    # ---- lookup and allocation -------------------------------------------------------------

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of a sequence with no blocks yet: (blocks, tokens they hold).

        Never covers the last known token (the step must compute it to get its logits).
        """
        if not self.enable_caching or seq.block_table or self._stale_adapter(seq):
            return [], 0
        self._extend_hashes(seq, seq.num_tokens)
        max_blocks = cacheable_blocks(seq.num_tokens, self.block_size)
        bs = self.block_size
        blocks: list[KVCacheBlock] = []
        for i in range(max_blocks):
            block = self.pool.get_cached_block(seq.block_hashes[i], tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * bs

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int,
                          computed_blocks: list[KVCacheBlock] | None = None) -> int:
        """Free blocks that allocate_slots(seq, num_new_tokens, computed_blocks) would consume."""
        computed_blocks = computed_blocks or []
        num_computed = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        total = -(-(num_computed + num_new_tokens) // self.block_size)
        need = max(0, total - len(seq.block_table) - len(computed_blocks))
        need += sum(1 for b in computed_blocks if b.ref_cnt == 0)  # revived from the free queue
        if self._shared_write_block(seq, num_computed) is not None and num_new_tokens > 0:
            need += 1  # copy-on-write
        return need

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: list[KVCacheBlock] | None = None) -> list[tuple[int, int]] | None:
        """Make room for num_new_tokens after the computed ones; None (and no change) if blocks run out.

        computed_blocks (from get_computed_blocks, same step) join the table first and advance
        seq.num_computed_tokens. Returns the (src, dst) block copies the runner must do before
        the forward pass: a shared partial last block is copied on the first write.
        """
        bs = self.block_size
        table = seq.block_table
        if not computed_blocks:  # the hot path: running sequences, mostly decodes
            num_computed = seq.num_computed_tokens
            grow = (num_computed + num_new_tokens + bs - 1) // bs - len(table)
            shared = self._shared_write_block(seq, num_computed) if num_new_tokens > 0 else None
            if grow <= 0 and shared is None:
                return []
            if max(grow, 0) + (shared is not None) > self.pool.num_free_blocks:
                self.alloc_failures += 1
                return None
        else:
            if self.num_blocks_needed(seq, num_new_tokens, computed_blocks) > self.pool.num_free_blocks:
                self.alloc_failures += 1
                return None
            self.pool.touch(computed_blocks)
            self.pins.refresh(computed_blocks, self.now)
            if seq.num_preemptions == 0:
                seq.cached_by_tier = self._tiers(computed_blocks)
            table.extend(b.block_id for b in computed_blocks)
            seq.num_computed_tokens += len(computed_blocks) * bs
            self._num_registered[seq.seq_id] = len(table)
            shared = None  # prefix hits are full blocks: nothing to copy
            grow = (seq.num_computed_tokens + num_new_tokens + bs - 1) // bs - len(table)
        copies: list[tuple[int, int]] = []
        if shared is not None:
            (new,) = self.pool.get_new_blocks(1)
            self.pool.free_blocks([shared])
            table[seq.num_computed_tokens // bs] = new.block_id
            copies.append((shared.block_id, new.block_id))
        if grow > 0:
            table.extend(b.block_id for b in self.pool.get_new_blocks(grow))
        return copies

    def _tiers(self, blocks: list[KVCacheBlock]) -> tuple[int, int, int]:
        """Prefix-hit tokens by where their blocks came from; an imported block counts as its origin once."""
        counts = [0, 0, 0]
        for b in blocks:
            counts[TIERS.index(b.origin or "device")] += self.block_size
            b.origin = None
        return counts[0], counts[1], counts[2]

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries_tokens += num_query_tokens
        self.prefix_hits_tokens += num_hit_tokens

    # ---- after a step ----------------------------------------------------------------------

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's blocks that are now full of computed tokens in the prefix cache."""
        if not self.enable_caching or self._stale_adapter(seq):
            return
        end = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        start = self._num_registered.get(seq.seq_id, 0)
        if end > start:
            self._register(seq, start, end)
        if seq.params.cache_pin is not None and not seq.pinned and seq.index == 0:
            self._pin(seq, max(end, start))

    def _register(self, seq: Sequence, start: int, end: int) -> None:
        self._extend_hashes(seq, end * self.block_size)
        bs = self.block_size
        self.pool.cache_blocks(
            [self.pool.blocks[b] for b in seq.block_table[start:end]],
            seq.block_hashes[start:end],
            [tuple(seq.token_ids[i * bs:(i + 1) * bs]) for i in range(start, end)],
            seq.block_hashes[start - 1] if start else None,
            seq.lora.name if seq.lora is not None else None,
        )
        self._num_registered[seq.seq_id] = end

    # ---- pins (engine/kv/pins.py) ------------------------------------------------------------

    def tick(self, now: float) -> int:
        """A step starts at `now`: pins whose TTL has passed are dropped; how many blocks."""
        self.now = now
        return self.pins.expire(now)

    def pin_blocks(self, seq: Sequence) -> int:
        """The whole blocks of seq's cache_control prefix (0 when it has none or pinning is off)."""
        pin = seq.params.cache_pin
        if pin is None or not self.pins.enabled or seq.index != 0:
            return 0
        return min(pin.num_tokens, seq.num_prompt_tokens) // self.block_size

    def reserve_pin(self, seq: Sequence) -> None:
        """Room for the blocks of seq's prefix not pinned yet, before it is queued; PinLimitError beyond a limit."""
        n = self.pin_blocks(seq)
        if n == 0 or self._stale_adapter(seq):
            return
        held = [b for b in self.cached_run(self.hash_prompt(seq)[:n]) if self.pins.is_pinned(b)]
        self.pins.reserve(seq.seq_id, seq.fairness_id, n - len(held), lambda: not seq.is_finished)

    def _pin(self, seq: Sequence, registered: int) -> None:
        n = self.pin_blocks(seq)
        if registered < n:
            return  # its prefix is still being computed
        seq.pinned = True
        pin = seq.params.cache_pin
        if n == 0 or pin is None:
            self.pins.release(seq.seq_id)
            return
        self.pins.pin(seq.seq_id, self.cached_run(seq.block_hashes[:n]), seq.fairness_id, pin.ttl_s, self.now)
        seq.num_cache_created_tokens = max(0, min(pin.num_tokens, seq.num_prompt_tokens) - seq.num_cached_tokens)

    # ---- blocks between engines (engine/kv/transfer.py) --------------------------------------

    def cached_run(self, hashes: Seq[int]) -> list[KVCacheBlock]:
        """The cached blocks of the leading run of `hashes` this cache holds."""
        out: list[KVCacheBlock] = []
        for h in hashes:
            block = self.pool.cached.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def hash_prompt(self, seq: Sequence) -> list[int]:
        """The chained hashes of the sequence's full blocks (computed once, as a prefix lookup would)."""
        if self.enable_caching and not self._stale_adapter(seq):
            self._extend_hashes(seq, seq.num_tokens)
        return seq.block_hashes

    def import_blocks(self, prefix: Seq[int], hashes: Seq[int], tokens: Seq[tuple[int, ...]], lora_name: str | None,
                      write: Callable[[list[int], list[int]], None], origin: str = "peer") -> tuple[int, int]:
        """Take in the blocks `hashes` (with their `tokens`) that follow `prefix` in one hash chain: those not cached
        yet get free blocks, `write(block_ids, rows)` fills them from rows of the payload, and they enter the prefix
        cache (a `stored` event) free, as if computed here. The chain's blocks held already are kept from eviction
        meanwhile. Nothing is taken when a block of `prefix` is no longer cached (the import could never be hit);
        fewer are when free blocks run short. `origin` ("peer", "lower_tier") is where the first request to read a block
counts it from. Returns (blocks imported, blocks of `hashes` held already)."""
        if not self.enable_caching:
            return 0, 0
        held = self.cached_run(prefix)
        if len(held) < len(prefix):
            return 0, 0
        present = 0
        while present < len(hashes) and self.pool.get_cached_block(hashes[present], tokens[present]) is not None:
            held.append(self.pool.cached[hashes[present]])
            present += 1
        self.pool.touch(held)
        try:
            n = min(len(hashes) - present, self.pool.num_free_blocks)
            if n <= 0:
                return 0, present
            blocks = self.pool.get_new_blocks(n)
            try:
                write([b.block_id for b in blocks], list(range(present, present + n)))
                parent = hashes[present - 1] if present else (prefix[-1] if prefix else None)
                self.pool.cache_blocks(blocks, list(hashes[present:present + n]), list(tokens[present:present + n]),
                                       parent, lora_name)
                for b in blocks:
                    if b.block_hash is not None:
                        b.origin = origin
            finally:
                self.pool.free_blocks(reversed(blocks))
            return n, present
        finally:
            self.pool.free_blocks(reversed(held))

    # ---- sharing and release ---------------------------------------------------------------

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let child share every block holding parent's computed tokens (one more reference each)."""
        if child.block_table:
            raise ValueError(f"fork target {child!r} already holds blocks")
        table = parent.block_table[:-(-parent.num_computed_tokens // self.block_size)]
        self.pool.touch(self.pool.blocks[b] for b in table)
        child.block_table = list(table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        if parent.seq_id in self._num_registered:
            self._num_registered[child.seq_id] = self._num_registered[parent.seq_id]

    def free(self, seq: Sequence) -> None:
        """Release every block of the sequence, tail first; a second call is a no-op."""
        table, seq.block_table = seq.block_table, []
        self.pool.free_blocks(self.pool.blocks[b] for b in reversed(table))
        seq.num_computed_tokens = 0
        self._num_registered.pop(seq.seq_id, None)

    def free_tail(self, seq: Sequence) -> None:
        """Release the blocks past those holding seq's known tokens (slots of rejected draft tokens, engine/spec/);
        they never held a full block of computed tokens, so none is in the prefix cache."""
        keep = -(-seq.num_tokens // self.block_size)
        tail, seq.block_table = seq.block_table[keep:], seq.block_table[:keep]
        self.pool.free_blocks(self.pool.blocks[b] for b in reversed(tail))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, pinned ones too, while no request holds a block."""
        pinned = self.pins.block_ids()
        if pinned and self.pool.num_used_blocks == len(pinned) and all(
                self.pool.blocks[b].ref_cnt == 1 for b in pinned):
            self.pins.unpin_all()
        done = self.pool.reset_prefix_cache()
        if done and self.lower is not None:
            self.lower.clear()
        return done

    # ---- LoRA adapters ---------------------------------------------------------------------

    def on_adapter_load(self, name: str, adapter_id: int) -> None:
        """A request runs under this load of adapter `name`. A newer load than the one whose blocks are cached (an
        unload and load under the same name, possibly other weights) takes every block computed under the name out
        of the cache (one `removed` event), and requests of the older load cache and find nothing more."""
        current = self.lora_ids.get(name)
        if current is not None and adapter_id <= current:
            return
        if current is not None:
            self.pool.uncache_adapter(name)
            if self.lower is not None:
                self.lower.forget_adapter(name)
        self.lora_ids[name] = adapter_id

    def _stale_adapter(self, seq: Sequence) -> bool:
        lora = seq.lora
        return lora is not None and self.lora_ids.get(lora.name, lora.id) != lora.id

    # ---- observability ---------------------------------------------------------------------

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def evictions(self) -> int:
        return self.pool.num_evictions

    @property
    def last_event_seq(self) -> int:
        return self.events.last_seq

    def snapshot(self) -> list[int]:
        """Every hash the prefix cache holds now (pair with last_event_seq after draining events)."""
        return self.pool.cached_hashes()

    def drain_events(self) -> list[KVEvent]:
        return self.events.drain_events()

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_total_blocks=self.num_blocks, num_used_blocks=self.pool.num_used_blocks,
            num_free_blocks=self.pool.num_free_blocks, num_cached_blocks=len(self.pool.cached),
            usage=self.usage, prefix_queries_tokens=self.prefix_queries_tokens,
            prefix_hits_tokens=self.prefix_hits_tokens, alloc_failures=self.alloc_failures,
            evictions=self.evictions, preemptions=self.num_preemptions, pinned_blocks=self.pins.num_pinned)

    # ---- internals -------------------------------------------------------------------------

    def _shared_write_block(self, seq: Sequence, num_computed: int) -> KVCacheBlock | None:
        """The block the next token would be written into, if it is already held and shared."""
        idx = num_computed // self.block_size
        if idx >= len(seq.block_table):
            return None
        block = self.pool.blocks[seq.block_table[idx]]
        return block if block.ref_cnt > 1 else None

    def _extend_hashes(self, seq: Sequence, num_tokens: int) -> None:
        """Extend seq.block_hashes over every full block of its first num_tokens tokens."""
        bs = self.block_size
        hashes = seq.block_hashes
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), min(num_tokens, seq.num_tokens) // bs):
            parent = hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs],
                                seq.cache_salt if i == 0 else None, self.hash_seed,
                                seq.lora.name if i == 0 and seq.lora is not None else None)
            hashes.append(parent)

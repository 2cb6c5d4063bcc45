"""Blocks between the KV cache and its lower tier (engine/kv/tier.py).

Spill: a cached block the pool evicts for new content is copied to the tier first (the pool's `on_evict`, called
before the forward pass overwrites it) and announced there (a `stored` event with the tier's medium; blocks the
tier lets go to make room, a `removed` one). Reload: when a request arrives, the blocks of its prompt that follow
what the cache holds and that the tier holds (same hash, same tokens) are copied back into the cache as cached
blocks (engine/kv/transfer.py's import, a `stored` event), so the request finds them as prefix hits instead of
prefilling them. Both run on the engine core, between steps.
"""

from __future__ import annotations

from collections.abc import Sequence

from contract.cacheable import cacheable_blocks
from engine.kv import transfer
from engine.kv.manager import KVCacheManager
from engine.kv.tier import KVTier
from engine.sequence import Sequence as Seq


class Offload:
    def __init__(self, kv: KVCacheManager, kv_caches: transfer.KVCaches, tier: KVTier):
        self.kv = kv
        self.kv_caches = kv_caches
        self.tier = tier
        self.spilled_blocks = 0
        self.reloaded_blocks = 0
        kv.pool.on_evict = self.spill
        kv.lower = self

    def spill(self, evicted: Sequence[tuple[int, int, tuple[int, ...], str | None]]) -> None:
        per = transfer.block_bytes(self.kv_caches)
        payload = memoryview(bytearray(per * len(evicted)))
        transfer.gather(self.kv_caches, [block_id for block_id, _, _, _ in evicted], payload)
        dropped: list[int] = []
        kept: dict[str | None, list[int]] = {}
        for i, (_, h, tokens, lora) in enumerate(evicted):
            dropped += self.tier.put(h, tokens, lora, bytes(payload[i * per:(i + 1) * per]))
            if h in self.tier:
                kept.setdefault(lora, []).append(h)
        events, medium = self.kv.events, self.tier.medium
        events.removed([h for h in dropped if h not in self.tier], medium)
        for lora, hashes in kept.items():
            events.stored(hashes, None, lora, medium)
        self.spilled_blocks += sum(len(h) for h in kept.values())

    def reload(self, seq: Seq) -> int:
        """Copy the prompt's blocks the tier holds, after those the cache holds, back into the cache; how many."""
        kv, bs = self.kv, self.kv.block_size
        hashes = kv.hash_prompt(seq)
        limit = min(len(hashes), cacheable_blocks(seq.num_tokens, bs))
        held = len(kv.cached_run(hashes[:limit]))
        found: list[tuple[tuple[int, ...], bytes]] = []
        lora = None
        for i in range(held, limit):
            got = self.tier.get(hashes[i])
            if got is None or got[0].tokens != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
                break
            if found and got[0].lora != lora:
                break
            lora = got[0].lora
            found.append((got[0].tokens, got[1]))
        if not found:
            return 0
        payload = memoryview(bytearray().join(p for _, p in found))
        imported, _ = transfer.import_blocks(kv, self.kv_caches, hashes[:held], hashes[held:held + len(found)],
                                             [t for t, _ in found], lora, payload, origin="lower_tier")
        self.reloaded_blocks += imported
        return imported

    def forget_adapter(self, lora_name: str) -> None:
        """An adapter was loaded anew: its blocks in the tier are stale too."""
        gone = self.tier.adapter_hashes(lora_name)
        for h in gone:
            self.tier.drop(h)
        self.kv.events.removed(gone, self.tier.medium)

    def clear(self) -> None:
        self.tier.clear()  # the cache's `cleared` event covers the tier too

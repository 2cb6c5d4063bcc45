"""Blocks in and out of the paged KV cache, for transfers between engines (contract/kv_transfer.py).

`export_blocks` copies the leading run of wanted blocks the prefix cache holds into a buffer (a region of the
front end's arena, engine/core/arena.py); `import_blocks` takes a verified payload from one into new blocks of
the pool and registers them in the prefix cache as if computed here (the same `stored` events). Both run on the
engine core between steps, so no step sees a half-written block and nothing stays held afterwards: the imported
blocks are free and cached, evictable like any other.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from contract.kv_transfer import Layout
from engine.kv.manager import KVCacheManager

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def layout_of(model_name: str, kv_caches: KVCaches, hash_seed: int) -> Layout:
    k = kv_caches[0][0]  # [num_blocks, block_size, kv heads, head dim]
    return Layout(model_name, k.shape[1], str(k.dtype).removeprefix("torch."), len(kv_caches), k.shape[2],
                  k.shape[3], hash_seed)


def export_blocks(kv: KVCacheManager, kv_caches: KVCaches, hashes: Sequence[int], max_blocks: int, out: memoryview
                  ) -> tuple[list[int], list[tuple[int, ...]], str | None, int]:
    """(hashes, their tokens, their adapter, payload bytes written to `out`) of the leading run of `hashes` the
    cache holds, at most max_blocks and as many as `out` holds, all computed under one adapter."""
    per_block = block_bytes(kv_caches)
    blocks = kv.cached_run(hashes[:min(max_blocks, len(out) // per_block)])
    if not blocks:
        return [], [], None, 0
    lora = blocks[0].lora_name
    blocks = [b for b in blocks[:next((i for i, b in enumerate(blocks) if b.lora_name != lora), len(blocks))]]
    gather(kv_caches, [b.block_id for b in blocks], out)
    return ([b.block_hash for b in blocks], [b.token_ids for b in blocks], lora,  # type: ignore[misc]
            len(blocks) * per_block)


def block_bytes(kv_caches: KVCaches) -> int:
    k = kv_caches[0][0]
    return 2 * len(kv_caches) * k[0].numel() * k.element_size()


def _blocks_view(kv_caches: KVCaches, buf: memoryview, n: int) -> torch.Tensor:
    """buf's first n blocks as [block, layer, K|V, slot, kv head, head dim] (no copy)."""
    k0 = kv_caches[0][0]
    data = torch.frombuffer(buf, dtype=torch.uint8, count=n * block_bytes(kv_caches))
    return data.view(k0.dtype).view(n, len(kv_caches), 2, *k0.shape[1:])


def gather(kv_caches: KVCaches, block_ids: Sequence[int], out: memoryview) -> None:
    """The blocks' K and V into `out`, laid out [block, layer, K|V, slot, kv head, head dim]."""
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=kv_caches[0][0].device)
    dst = _blocks_view(kv_caches, out, len(block_ids))
    for layer, (k, v) in enumerate(kv_caches):
        dst[:, layer, 0].copy_(k.index_select(0, idx))
        dst[:, layer, 1].copy_(v.index_select(0, idx))


def import_blocks(kv: KVCacheManager, kv_caches: KVCaches, prefix: Sequence[int], hashes: Sequence[int],
                  tokens: Sequence[tuple[int, ...]], lora: str | None, payload: memoryview,
                  origin: str = "peer") -> tuple[int, int]:
    """Take in blocks that follow `prefix` (hashes of the chain's blocks this cache should hold already), their
    payload laid out as `gather` writes it; `origin`: where they came from ("peer", "lower_tier"), what the first
    request to read them reports. Returns (blocks imported, blocks it held already)."""
    if len(payload) != len(hashes) * block_bytes(kv_caches):
        raise ValueError(f"a payload of {len(payload)} bytes does not hold {len(hashes)} blocks")
    if not hashes:
        return 0, 0
    device = kv_caches[0][0].device
    data = _blocks_view(kv_caches, payload, len(hashes))

    def write(block_ids: list[int], rows: list[int]) -> None:
        idx = torch.tensor(block_ids, dtype=torch.long, device=device)
        src = data[rows[0]:rows[-1] + 1].to(device)
        for layer, (k, v) in enumerate(kv_caches):
            k.index_copy_(0, idx, src[:, layer, 0])
            v.index_copy_(0, idx, src[:, layer, 1])

    return kv.import_blocks(prefix, hashes, tokens, lora, write, origin)

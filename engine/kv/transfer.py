"""Blocks in and out of the paged KV cache, for transfers between engines (contract/kv_transfer.py).

`export_blocks` copies the leading run of wanted blocks the prefix cache holds into one payload; `import_blocks`
takes a verified payload into new blocks of the pool and registers them in the prefix cache as if computed
here (the same `stored` events). Both run on the engine core between steps, so no step sees a half-written
block and nothing stays held afterwards: the imported blocks are free and cached, evictable like any other.
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


def export_blocks(kv: KVCacheManager, kv_caches: KVCaches, hashes: Sequence[int], max_blocks: int
                  ) -> tuple[list[int], list[tuple[int, ...]], str | None, bytes]:
    """(hashes, their tokens, their adapter, payload) of the leading run of `hashes` the cache holds, at most
    max_blocks, all computed under one adapter."""
    blocks = kv.cached_run(hashes[:max_blocks])
    if not blocks:
        return [], [], None, b""
    lora = blocks[0].lora_name
    blocks = [b for b in blocks[:next((i for i, b in enumerate(blocks) if b.lora_name != lora), len(blocks))]]
    payload = gather(kv_caches, [b.block_id for b in blocks])
    return [b.block_hash for b in blocks], [b.token_ids for b in blocks], lora, payload  # type: ignore[misc]


def gather(kv_caches: KVCaches, block_ids: Sequence[int]) -> bytes:
    """The blocks' K and V as bytes, laid out [block, layer, K|V, slot, kv head, head dim]."""
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=kv_caches[0][0].device)
    data = torch.stack([torch.stack((k.index_select(0, idx), v.index_select(0, idx)), 1) for k, v in kv_caches], 1)
    return data.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def import_blocks(kv: KVCacheManager, kv_caches: KVCaches, prefix: Sequence[int], hashes: Sequence[int],
                  tokens: Sequence[tuple[int, ...]], lora: str | None, payload: bytes) -> tuple[int, int]:
    """Take in blocks that follow `prefix` (hashes of the chain's blocks this cache should hold already), their
    payload laid out as `gather` writes it. Returns (blocks imported, blocks it held already)."""
    k0 = kv_caches[0][0]
    dtype, device = k0.dtype, k0.device
    shape = (len(hashes), len(kv_caches), 2, *k0.shape[1:])
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).view(shape)

    def write(block_ids: list[int], rows: list[int]) -> None:
        idx = torch.tensor(block_ids, dtype=torch.long, device=device)
        src = data[rows[0]:rows[-1] + 1].to(device)
        for layer, (k, v) in enumerate(kv_caches):
            k.index_copy_(0, idx, src[:, layer, 0])
            v.index_copy_(0, idx, src[:, layer, 1])

    return kv.import_blocks(prefix, hashes, tokens, lora, write)

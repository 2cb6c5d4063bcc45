"""Chained block hashes for the prefix cache, shared by the engine and the router.

h_i = H(seed, h_{i-1}, token_ids_i, extra_i), with H = xxh3_128. extra_0 carries the request's LoRA
adapter name, if any (blocks never cross adapters, nor adapter and base model), and its cache_salt (tenant
isolation); later blocks carry no extra. Without an adapter the hash is what it was before adapters. Only *full* blocks are hashed. The
seed is a fleet-wide setting so every engine and router computes the same hashes.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

DEFAULT_HASH_SEED = 0x6B7666  # "kvf"
_NO_PARENT = b"\x00" * 16


def hash_block(parent: int | None, token_ids: Sequence[int], extra: str | None = None,
               seed: int = DEFAULT_HASH_SEED, adapter: str | None = None) -> int:
    """The 128-bit hash of one full block, chained on its parent's hash (None for block 0); adapter: the LoRA
    adapter's name, for block 0 of a request that names one."""
    h = xxhash.xxh3_128(seed=seed)
    h.update(_NO_PARENT if parent is None else parent.to_bytes(16, "little"))
    h.update(array("q", token_ids).tobytes())
    if adapter:  # tagged and length-prefixed: no cache_salt can spell an adapter
        name = adapter.encode("utf-8")
        h.update(b"\x02" + len(name).to_bytes(4, "little") + name)
    if extra:
        h.update(b"\x01" + extra.encode("utf-8"))
    return h.intdigest()


def hash_blocks(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
                seed: int = DEFAULT_HASH_SEED, parent: int | None = None, start_block: int = 0,
                adapter: str | None = None) -> list[int]:
    """Hashes of every full block of token_ids from start_block on, chained from parent (adapter: the request's
    LoRA adapter name, None for the base model)."""
    out: list[int] = []
    n_full = len(token_ids) // block_size
    for i in range(start_block, n_full):
        first = i == 0
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], cache_salt if first else None,
                            seed, adapter if first else None)
        out.append(parent)
    return out

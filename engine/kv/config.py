"""The paged KV cache's configuration: frozen, validated once (a bad value raises ConfigError naming it)."""

from __future__ import annotations

from dataclasses import dataclass

from contract.hashing import DEFAULT_HASH_SEED
from engine.config import check, check_int

MAX_BLOCK_SIZE = 256
BLOCK_SIZES = f"a power of two between 1 and {MAX_BLOCK_SIZE}"


def valid_block_size(value: object) -> bool:
    """The one rule for a KV block size (the engine's --block-size is checked with it too)."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_BLOCK_SIZE \
        and value & (value - 1) == 0


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: `num_blocks` blocks of `block_size` token slots each (per layer)."""

    block_size: int = 16
    num_blocks: int = 1024
    enable_prefix_caching: bool = True
    hash_seed: int = DEFAULT_HASH_SEED
    max_pending_kv_events: int = 65536  # undrained events beyond this drop the oldest (a seq gap)
    max_pinned_blocks: int = 0  # blocks cache_control prefixes may pin (engine/kv/pins.py); 0: pinning off
    max_pinned_blocks_per_tenant: int = 0  # of them, per tenant (at most max_pinned_blocks)

    def __post_init__(self) -> None:
        check(valid_block_size(self.block_size), "block_size", f"block_size must be {BLOCK_SIZES}, got {self.block_size!r}")
        check_int("num_blocks", self.num_blocks, 1)
        check(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching",
              f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        check_int("hash_seed", self.hash_seed, 0)
        check(self.hash_seed < 2**64, "hash_seed", f"hash_seed must fit in 64 bits, got {self.hash_seed}")
        check_int("max_pending_kv_events", self.max_pending_kv_events, 1)
        check_int("max_pinned_blocks", self.max_pinned_blocks, 0)
        check(self.max_pinned_blocks < self.num_blocks, "max_pinned_blocks",
              f"max_pinned_blocks must leave blocks to allocate: below num_blocks ({self.num_blocks}), got "
              f"{self.max_pinned_blocks}")
        check_int("max_pinned_blocks_per_tenant", self.max_pinned_blocks_per_tenant, 0)

    @property
    def num_slots(self) -> int:
        return self.block_size * self.num_blocks

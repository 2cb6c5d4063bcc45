"""Engine configuration shared by the KV cache manager and the scheduler: frozen, validated once.

Every bad value raises ConfigError, a ValueError whose `field` names the offending setting, so the
CLI and the HTTP edge can point at it.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv.hashing import DEFAULT_HASH_SEED

MAX_BLOCK_SIZE = 256


class ConfigError(ValueError):
    """A configuration value is invalid; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: `num_blocks` blocks of `block_size` token slots each (per layer)."""

    block_size: int = 16
    num_blocks: int = 1024
    enable_prefix_caching: bool = True
    hash_seed: int = DEFAULT_HASH_SEED
    max_pending_kv_events: int = 65536  # undrained events beyond this drop the oldest (a seq gap)

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1)
        _check(self.block_size <= MAX_BLOCK_SIZE and self.block_size & (self.block_size - 1) == 0,
               "block_size", f"block_size must be a power of two between 1 and {MAX_BLOCK_SIZE}, "
               f"got {self.block_size}")
        _check_int("num_blocks", self.num_blocks, 1)
        _check(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching",
               f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        _check_int("hash_seed", self.hash_seed, 0)
        _check(self.hash_seed < 2**64, "hash_seed", f"hash_seed must fit in 64 bits, got {self.hash_seed}")
        _check_int("max_pending_kv_events", self.max_pending_kv_events, 1)

    @property
    def num_slots(self) -> int:
        return self.block_size * self.num_blocks


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits of continuous batching and the longest sequence (prompt + output) served."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_model_len", self.max_model_len, 1)
        # Chunked prefill lets a prompt longer than the budget run over several steps, but every
        # running sequence must be able to get at least one token per step.
        _check(self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
               f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
               f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode each step")


def _check_int(field: str, value: object, minimum: int) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool), field,
           f"{field} must be an integer, got {value!r}")
    _check(value >= minimum, field, f"{field} must be >= {minimum}, got {value}")


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ConfigError(field, message)

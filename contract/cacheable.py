"""Which leading part of a prompt a prefix-cache hit may cover: whole blocks, never the last prompt token
(the step must compute that token to get its logits). The engine's KV manager allocates by this rule and
the router predicts hits by it."""

from __future__ import annotations


def cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading full blocks of a num_tokens-token prompt a prefix hit can cover."""
    return max(num_tokens - 1, 0) // block_size


def cacheable_tokens(num_tokens: int, block_size: int = 1) -> int:
    """How many leading prompt tokens a prefix hit can cover (block_size 1: an upper bound for any size)."""
    return cacheable_blocks(num_tokens, block_size) * block_size

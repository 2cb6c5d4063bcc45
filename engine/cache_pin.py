"""What a request asks the KV cache to pin: the prefix its cache_control marks (contract/cache_control.py), measured
in prompt tokens by engine/server/prompt_cache.py, held by engine/kv/pins.py. Rides on SamplingParams."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CachePin:
    """Pin the whole KV blocks among the first `num_tokens` prompt tokens for `ttl_s` seconds."""

    num_tokens: int
    ttl_s: float

    def __post_init__(self) -> None:
        if self.num_tokens < 0 or not self.ttl_s > 0:
            raise ValueError(f"a cache pin needs num_tokens >= 0 and ttl_s > 0, got {self}")

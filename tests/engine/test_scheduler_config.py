"""CacheConfig and SchedulerConfig: defaults and validation errors that name the field."""

from __future__ import annotations

import dataclasses

import pytest

from contract.errors import ConfigError
from contract.hashing import DEFAULT_HASH_SEED
from engine.config import SchedulerConfig
from engine.kv.config import CacheConfig


def test_defaults_and_positional_order():
    c = CacheConfig()
    assert (c.block_size, c.num_blocks, c.enable_prefix_caching, c.hash_seed) == (16, 1024, True, DEFAULT_HASH_SEED)
    assert CacheConfig(32, 10, False, 5) == CacheConfig(block_size=32, num_blocks=10, enable_prefix_caching=False,
                                                        hash_seed=5)
    assert CacheConfig(8, 10).num_slots == 80
    s = SchedulerConfig()
    assert (s.max_num_batched_tokens, s.max_num_seqs, s.max_model_len) == (2048, 64, 2048)
    assert SchedulerConfig(512, 8, 4096).max_model_len == 4096
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.block_size = 8


@pytest.mark.parametrize("kwargs, field, text", [
    ({"block_size": 0}, "block_size", "block_size must be a power of two between 1 and 256, got 0"),
    ({"block_size": 12}, "block_size", "power of two"),
    ({"block_size": 512}, "block_size", "power of two"),
    ({"block_size": 16.0}, "block_size", "power of two between 1 and 256, got 16.0"),
    ({"num_blocks": 0}, "num_blocks", "num_blocks must be >= 1"),
    ({"num_blocks": True}, "num_blocks", "must be an integer"),
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching", "must be a bool"),
    ({"hash_seed": -1}, "hash_seed", ">= 0"),
    ({"hash_seed": 2**64}, "hash_seed", "64 bits"),
    ({"max_pending_kv_events": 0}, "max_pending_kv_events", ">= 1"),
])
def test_cache_config_errors_name_the_field(kwargs, field, text):
    with pytest.raises(ConfigError, match=text) as exc:
        CacheConfig(**kwargs)
    assert exc.value.field == field and isinstance(exc.value, ValueError)


@pytest.mark.parametrize("kwargs, field, text", [
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens", ">= 1"),
    ({"max_num_seqs": 0}, "max_num_seqs", ">= 1"),
    ({"max_model_len": -5}, "max_model_len", ">= 1"),
    ({"max_model_len": "2048"}, "max_model_len", "must be an integer"),
    ({"max_num_batched_tokens": 16, "max_num_seqs": 32}, "max_num_batched_tokens", "at least max_num_seqs"),
])
def test_scheduler_config_errors_name_the_field(kwargs, field, text):
    with pytest.raises(ConfigError, match=text) as exc:
        SchedulerConfig(**kwargs)
    assert exc.value.field == field

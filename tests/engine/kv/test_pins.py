"""Pinned KV blocks (cache_control prefixes): exact block ids, references, TTLs, limits and events."""

from __future__ import annotations

import pytest

from contract.errors import ConfigError
from contract.kv_events import KVEventKind
from engine.cache_pin import CachePin
from engine.errors import PinLimitError
from engine.kv.config import CacheConfig
from engine.kv.manager import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceStatus

SYSTEM = list(range(1000, 1048))  # a 3-block prefix (block size 16)


def manager(num_blocks: int = 10, max_pinned: int = 4, per_tenant: int = 4) -> KVCacheManager:
    return KVCacheManager(CacheConfig(block_size=16, num_blocks=num_blocks, max_pinned_blocks=max_pinned,
                                      max_pinned_blocks_per_tenant=per_tenant))


def pinned_seq(rid: str, prompt: list[int], tokens: int = 48, ttl: float = 300.0, tenant: str = "") -> Sequence:
    return Sequence(rid, prompt, SamplingParams(cache_pin=CachePin(tokens, ttl), fairness_id=tenant))


def prefill(kv: KVCacheManager, seq: Sequence) -> int:
    """Admit a sequence as the scheduler does (its cached tokens recorded) and compute its prompt; its hit."""
    blocks, hit = kv.get_computed_blocks(seq)
    assert kv.allocate_slots(seq, seq.num_tokens - hit, blocks) is not None
    seq.num_cached_tokens = hit
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)
    return hit


def run(kv: KVCacheManager, seq: Sequence) -> int:
    """Admit a sequence (reserving its pin), prefill it whole and finish it; its prefix hit."""
    kv.reserve_pin(seq)
    hit = prefill(kv, seq)
    seq.status = SequenceStatus.FINISHED_STOPPED
    kv.free(seq)
    return hit


def flood(kv: KVCacheManager, rounds: int, base: int = 5000) -> None:
    """Distinct 2-block prompts, one after another: each round reuses the least recently freed blocks."""
    for k in range(rounds):
        seq = Sequence(f"flood-{base}-{k}", [base + 17 * k + i for i in range(17)])
        prefill(kv, seq)
        kv.free(seq)


def removed(kv: KVCacheManager) -> set[int]:
    return {h for e in kv.drain_events() if e.kind is KVEventKind.REMOVED for h in e.block_hashes}


def test_a_pinned_prefix_holds_one_reference_per_block_and_survives_a_flood():
    kv = manager()
    kv.tick(0.0)
    a = pinned_seq("a", SYSTEM + [1, 2, 3, 4, 5])
    assert run(kv, a) == 0
    assert kv.pins.num_pinned == 3 and kv.pins.block_ids() == [0, 1, 2]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 1, 0]  # the pins' references; a's tail is free
    assert a.num_cache_created_tokens == 48
    hashes = a.block_hashes[:3]
    kv.drain_events()
    flood(kv, 20)  # 40 block allocations over the 7 unpinned blocks
    assert kv.evictions > 7
    assert not removed(kv) & set(hashes)  # routers are never told the pinned blocks left
    assert kv.cached_run(hashes) == [kv.pool.blocks[i] for i in (0, 1, 2)]
    b = pinned_seq("b", SYSTEM + [9, 9])
    assert run(kv, b) == 48
    assert b.num_cache_created_tokens == 0


def test_without_a_pin_the_same_flood_evicts_the_prefix():
    kv = manager()
    a = Sequence("a", SYSTEM + [1, 2, 3, 4, 5])
    run(kv, a)
    flood(kv, 20)
    assert kv.cached_run(a.block_hashes[:3]) == []
    assert run(kv, Sequence("b", SYSTEM + [9, 9])) == 0


def test_after_the_ttl_the_blocks_are_ordinary_lru_blocks_evicted_tail_first():
    kv = manager()
    kv.tick(0.0)
    a = pinned_seq("a", SYSTEM + [1, 2, 3, 4, 5], ttl=300.0)
    run(kv, a)
    assert kv.tick(299.9) == 0 and kv.pins.num_pinned == 3
    assert kv.tick(300.0) == 3 and kv.pins.num_pinned == 0
    assert [kv.pool.blocks[i].ref_cnt for i in range(3)] == [0, 0, 0]
    assert kv.pool.free_queue.block_ids()[-3:] == [2, 1, 0]  # tail first: the chain's end is evicted first
    assert len(kv.pool.cached) >= 3  # still cached: a hit now is an ordinary hit
    kv.drain_events()
    flood(kv, 20)
    assert set(a.block_hashes[:3]) <= removed(kv)


def test_a_read_refreshes_the_ttl():
    kv = manager()
    kv.tick(0.0)
    run(kv, pinned_seq("a", SYSTEM + [1]))
    kv.tick(200.0)
    assert run(kv, Sequence("reader", SYSTEM + [7, 7])) == 48  # no cache_control: a read still refreshes
    assert kv.tick(300.0) == 0 and kv.pins.num_pinned == 3
    assert kv.tick(499.9) == 0
    assert kv.tick(500.0) == 3


def test_a_second_pin_of_the_same_prefix_costs_nothing_and_keeps_the_longer_ttl():
    kv = manager(max_pinned=3, per_tenant=3)
    kv.tick(0.0)
    run(kv, pinned_seq("a", SYSTEM + [1], ttl=3600.0, tenant="t1"))
    kv.tick(10.0)
    b = pinned_seq("b", SYSTEM + [2], ttl=300.0, tenant="t2")  # every block pinned already: no room needed
    assert run(kv, b) == 48
    assert kv.pins.pinned_by("t1") == 3 and kv.pins.pinned_by("t2") == 0
    assert kv.tick(3609.9) == 0  # b's read at 10 refreshed the 1h pin: its own 5m mark asks for less
    assert kv.tick(3610.0) == 3


def test_only_whole_blocks_of_the_marked_prefix_are_pinned():
    kv = manager()
    kv.tick(0.0)
    a = pinned_seq("a", SYSTEM + [1, 2], tokens=40)  # 2.5 blocks marked
    run(kv, a)
    assert kv.pins.block_ids() == [0, 1]
    assert a.num_cache_created_tokens == 40


def test_limits_refuse_before_anything_is_held():
    kv = manager(num_blocks=12, max_pinned=4, per_tenant=3)
    kv.tick(0.0)
    run(kv, pinned_seq("a", SYSTEM + [1], tenant="t1"))  # 3 blocks: t1's whole share
    used = kv.pool.num_used_blocks
    other = pinned_seq("a2", list(range(2000, 2017)), tokens=16, tenant="t1")
    with pytest.raises(PinLimitError, match="tenant 't1' already pin"):
        kv.reserve_pin(other)
    assert kv.pins.num_reserved() == 0 and kv.pool.num_used_blocks == used
    run(kv, pinned_seq("b", list(range(3000, 3017)), tokens=16, tenant="t2"))  # the engine's 4th block
    with pytest.raises(PinLimitError, match="4 of this engine's 4"):
        kv.reserve_pin(pinned_seq("c", list(range(4000, 4017)), tokens=16, tenant="t3"))
    with pytest.raises(PinLimitError, match="requests without a tenant"):
        manager(max_pinned=4, per_tenant=1).reserve_pin(pinned_seq("d", list(range(5000, 5033)), tokens=32))
    kv.reserve_pin(pinned_seq("e", SYSTEM + [5], tenant="t3"))  # pinned already: needs no room
    kv.tick(300.0)  # every pin expired: room again
    kv.reserve_pin(pinned_seq("c", list(range(4000, 4017)), tokens=16, tenant="t3"))


def test_reservations_count_against_the_limits_until_the_request_pins_or_ends():
    kv = manager(max_pinned=4, per_tenant=4)
    kv.tick(0.0)
    a = pinned_seq("a", SYSTEM + [1])
    kv.reserve_pin(a)
    assert kv.pins.num_reserved() == 3
    with pytest.raises(PinLimitError):
        kv.reserve_pin(pinned_seq("b", list(range(2000, 2033)), tokens=32))
    prefill(kv, a)  # prefilled: pinned, reservation ended
    assert kv.pins.num_reserved() == 0 and kv.pins.num_pinned == 3


def test_an_aborted_request_leaks_nothing():
    kv = manager()
    kv.tick(0.0)
    a = pinned_seq("a", SYSTEM + [1, 2, 3])
    kv.reserve_pin(a)
    blocks, hit = kv.get_computed_blocks(a)
    assert kv.allocate_slots(a, 20, blocks) == []  # the first chunk of its prompt only
    a.num_computed_tokens += 20
    kv.cache_full_blocks(a)
    assert kv.pins.num_pinned == 0 and kv.pins.num_reserved() == 3  # its prefix is not computed yet
    a.status = SequenceStatus.FINISHED_ABORTED
    kv.free(a)
    assert kv.tick(1.0) == 0
    assert kv.pins.num_pinned == 0 and kv.pins.num_reserved() == 0
    assert kv.pool.num_free_blocks == kv.num_blocks


def test_pins_never_take_the_blocks_running_requests_need():
    with pytest.raises(ConfigError, match="must leave blocks to allocate"):
        CacheConfig(block_size=16, num_blocks=4, max_pinned_blocks=4)
    kv = manager(num_blocks=6, max_pinned=3, per_tenant=3)
    kv.tick(0.0)
    run(kv, pinned_seq("a", SYSTEM + [1]))
    big = Sequence("big", list(range(6000, 6047)))  # 3 blocks: exactly what pins leave
    assert prefill(kv, big) == 0
    assert kv.pool.num_free_blocks == 0 and kv.pins.num_pinned == 3


def test_reset_prefix_cache_drops_pins_when_nothing_else_is_held():
    kv = manager()
    kv.tick(0.0)
    run(kv, pinned_seq("a", SYSTEM + [1]))
    assert kv.reset_prefix_cache()
    assert kv.pins.num_pinned == 0 and kv.pool.num_free_blocks == kv.num_blocks and not kv.pool.cached


def test_pinning_off_accepts_and_ignores_cache_control():
    kv = manager(max_pinned=0, per_tenant=0)
    a = pinned_seq("a", SYSTEM + [1])
    assert run(kv, a) == 0
    assert kv.pins.num_pinned == 0 and a.pinned and a.num_cache_created_tokens == 0


def test_cached_tokens_by_tier_count_an_imported_block_once():
    kv = manager()
    src = Sequence("src", SYSTEM + [1])
    hashes = kv.hash_prompt(src)[:3]
    tokens = [tuple(SYSTEM[i * 16:(i + 1) * 16]) for i in range(3)]
    assert kv.import_blocks([], hashes[:2], tokens[:2], None, lambda ids, rows: None, origin="peer") == (2, 0)
    assert kv.import_blocks(hashes[:2], hashes[2:], tokens[2:], None, lambda ids, rows: None,
                            origin="lower_tier") == (1, 0)
    a = Sequence("a", SYSTEM + [1])
    assert prefill(kv, a) == 48
    assert a.cached_by_tier == (0, 16, 32)
    b = Sequence("b", SYSTEM + [2])
    assert prefill(kv, b) == 48
    assert b.cached_by_tier == (48, 0, 0)

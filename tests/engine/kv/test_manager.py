"""KV cache manager: exact block ids, hit counts, eviction order, copy-on-write, events."""

from __future__ import annotations

import pytest

from contract.hashing import hash_blocks
from engine.kv.config import CacheConfig
from engine.kv.manager import KVCacheManager
from engine.sequence import Sequence

SYSTEM = list(range(1000, 1048))  # a 3-block system prompt (block size 16)


def admit(kv: KVCacheManager, seq: Sequence, chunk: int | None = None):
    """Look up the cached prefix, allocate the rest (or one chunk of it) and 'compute' it."""
    blocks, hit = kv.get_computed_blocks(seq)
    n = seq.num_tokens - hit if chunk is None else min(chunk, seq.num_tokens - hit)
    copies = kv.allocate_slots(seq, n, blocks)
    assert copies is not None
    kv.record_prefix_query(seq.num_tokens, hit)
    seq.num_computed_tokens += n
    kv.cache_full_blocks(seq)
    return hit, copies


def step(kv: KVCacheManager, seq: Sequence, token: int):
    """Decode one token: append it, make room, compute it."""
    seq.append_token(token)
    copies = kv.allocate_slots(seq, 1)
    assert copies is not None
    seq.num_computed_tokens += 1
    kv.cache_full_blocks(seq)
    return copies


def test_shared_system_prompt_second_request_hits_48_tokens():
    kv = KVCacheManager(CacheConfig(block_size=16, num_blocks=10))
    a = Sequence("a", SYSTEM + [1, 2, 3, 4, 5])
    assert admit(kv, a) == (0, [])
    assert a.block_table == [0, 1, 2, 3]
    b = Sequence("b", SYSTEM + [7, 8, 9, 10, 11, 12, 13])
    hit, copies = admit(kv, b)
    assert (hit, copies) == (48, [])
    assert b.block_table == [0, 1, 2, 4]  # only its own last block is new
    assert b.num_computed_tokens == 55
    assert [kv.pool.blocks[i].ref_cnt for i in range(5)] == [2, 2, 2, 1, 1]
    assert (kv.prefix_queries_tokens, kv.prefix_hits_tokens) == (53 + 55, 48)
    assert kv.pool.num_used_blocks == 5 and kv.usage == pytest.approx(0.5)
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in range(5)] == [1, 1, 1, 0, 1]
    assert kv.pool.free_queue.block_ids()[0] == 3  # a's unhashable partial block is reused first


def test_block_hashes_match_the_router_hashing_and_stored_events():
    kv = KVCacheManager(CacheConfig(block_size=16, num_blocks=10))
    a = Sequence("a", SYSTEM + [1, 2], cache_salt="tenant-1")
    admit(kv, a, chunk=20)  # chunked: blocks register as they fill
    admit_rest = kv.allocate_slots(a, a.num_tokens - a.num_computed_tokens)
    assert admit_rest == []
    a.num_computed_tokens = a.num_tokens
    kv.cache_full_blocks(a)
    expected = hash_blocks(a.token_ids, 16, cache_salt="tenant-1", seed=kv.hash_seed)
    assert a.block_hashes == expected and len(expected) == 3
    evs = kv.drain_events()
    assert [(e.seq, e.kind, e.block_hashes, e.parent_hash) for e in evs] == [
        (1, "stored", tuple(expected[:1]), None), (2, "stored", tuple(expected[1:]), expected[0])]
    assert sorted(kv.snapshot()) == sorted(expected) and kv.last_event_seq == 2


def test_hit_never_covers_the_last_prompt_token():
    kv = KVCacheManager(CacheConfig(block_size=16, num_blocks=10))
    a = Sequence("a", SYSTEM)
    admit(kv, a)
    b = Sequence("b", SYSTEM)  # exactly 3 full blocks
    hit, _ = admit(kv, b)
    assert hit == 32 and b.block_table == [0, 1, 3]
    # b's third block has the same content as a's: the cache keeps a's, b's stays unhashed
    assert kv.pool.cached[b.block_hashes[2]].block_id == 2 and kv.pool.blocks[3].block_hash is None


def test_collision_guard_rejects_a_block_with_other_tokens():
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=8))
    a = Sequence("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(kv, a)
    kv.pool.blocks[1].token_ids = (6, 6, 6, 6)  # pretend block 1's hash collided with other content
    b = Sequence("b", [1, 2, 3, 4, 5, 6, 7, 8, 10])
    hit, _ = admit(kv, b)
    assert hit == 4 and b.block_table[:1] == [0] and b.block_table[1] != 1


def test_cache_salt_isolates_tenants():
    kv = KVCacheManager(CacheConfig(block_size=16, num_blocks=20))
    admit(kv, Sequence("a", SYSTEM + [1], cache_salt="t1"))
    assert admit(kv, Sequence("b", SYSTEM + [1], cache_salt="t2"))[0] == 0
    assert admit(kv, Sequence("c", SYSTEM + [1]))[0] == 0
    assert admit(kv, Sequence("d", SYSTEM + [2], cache_salt="t1"))[0] == 48


def test_exact_eviction_order_after_tail_first_free():
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=6))
    a = Sequence("a", list(range(1, 10)))  # 2 full blocks + 1 token
    admit(kv, a)
    assert a.block_table == [0, 1, 2]
    kv.free(a)
    # partial block 2 (no hash) first, then never-used 3,4,5, then a's chain tail-first: 1, 0
    assert kv.pool.free_queue.block_ids() == [2, 3, 4, 5, 1, 0]
    kv.drain_events()
    b = Sequence("b", list(range(50, 67)))  # 17 tokens: 5 blocks
    admit(kv, b)
    assert b.block_table == [2, 3, 4, 5, 1]
    assert kv.evictions == 1
    removed = [e for e in kv.drain_events() if e.kind == "removed"]
    assert [e.block_hashes for e in removed] == [(a.block_hashes[1],)]
    a2 = Sequence("a2", list(range(1, 10)))
    blocks, hit = kv.get_computed_blocks(a2)
    assert hit == 4 and [blk.block_id for blk in blocks] == [0]  # only the chain head survived


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=3))
    a = Sequence("a", list(range(10)))
    admit(kv, a)
    kv.free(a)
    b = Sequence("b", list(range(10)) + [99] * 8)  # would hit 2 free cached blocks, needs 5 blocks
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 8
    before = (kv.pool.free_queue.block_ids(), [blk.ref_cnt for blk in kv.pool.blocks])
    assert kv.allocate_slots(b, b.num_tokens - hit, blocks) is None
    assert kv.alloc_failures == 1 and b.block_table == [] and b.num_computed_tokens == 0
    assert (kv.pool.free_queue.block_ids(), [blk.ref_cnt for blk in kv.pool.blocks]) == before
    assert kv.num_blocks_needed(b, b.num_tokens - hit, blocks) == 5


def test_fork_shares_blocks_and_copies_the_partial_block_on_first_write():
    kv = KVCacheManager(CacheConfig(block_size=16, num_blocks=10))
    parent = Sequence("p", list(range(20)))  # block 0 full, block 1 holds 4 tokens
    admit(kv, parent)
    c1, c2 = Sequence("p", parent.token_ids, index=1), Sequence("p", parent.token_ids, index=2)
    kv.fork(parent, c1)
    kv.fork(parent, c2)
    assert c1.block_table == c2.block_table == [0, 1] and c1.num_computed_tokens == 20
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1)] == [3, 3]
    assert kv.pool.num_used_blocks == 2
    assert step(kv, c1, 5) == [(1, 2)] and c1.block_table == [0, 2]
    assert step(kv, c2, 6) == [(1, 3)] and c2.block_table == [0, 3]
    assert step(kv, parent, 7) == [] and parent.block_table == [0, 1]  # last holder writes in place
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [3, 1, 1, 1]
    assert step(kv, c1, 8) == []  # its own copy now
    for s in (parent, c1, c2):
        kv.free(s)
    assert kv.pool.num_used_blocks == 0


def test_fork_at_a_block_boundary_needs_no_copy():
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=10))
    parent = Sequence("p", list(range(8)))
    admit(kv, parent)
    child = Sequence("p", parent.token_ids, index=1)
    kv.fork(parent, child)
    assert step(kv, child, 1) == [] and child.block_table == [0, 1, 2]
    assert step(kv, parent, 2) == [] and parent.block_table == [0, 1, 3]


def test_free_is_idempotent_and_prefix_caching_can_be_disabled():
    kv = KVCacheManager(CacheConfig(block_size=16, num_blocks=10, enable_prefix_caching=False))
    a = Sequence("a", SYSTEM + [1])
    admit(kv, a)
    b = Sequence("b", SYSTEM + [1])
    assert admit(kv, b)[0] == 0 and b.block_table == [4, 5, 6, 7]
    assert a.block_hashes == [] and kv.snapshot() == [] and kv.drain_events() == []
    kv.free(a)
    kv.free(a)
    assert kv.pool.num_used_blocks == 4


def test_stats_and_reset():
    kv = KVCacheManager(CacheConfig(block_size=16, num_blocks=4))
    a = Sequence("a", SYSTEM + [1])
    admit(kv, a)
    st = kv.stats()
    assert (st.num_used_blocks, st.num_free_blocks, st.num_cached_blocks, st.usage) == (4, 0, 3, 1.0)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True and kv.snapshot() == []
    assert kv.drain_events()[-1].kind == "cleared"


# ---- blocks between engines (engine/kv/transfer.py) -----------------------------------------------------------


def _chain(tokens: list[int]) -> tuple[list[int], list[tuple[int, ...]]]:
    n = len(tokens) // 16
    return hash_blocks(tokens[:n * 16], 16, None, CacheConfig(16, 1).hash_seed), \
        [tuple(tokens[i * 16:(i + 1) * 16]) for i in range(n)]


def test_imported_blocks_are_cached_free_and_hit_like_computed_ones():
    kv = KVCacheManager(CacheConfig(block_size=16, num_blocks=8))
    hashes, tokens = _chain(SYSTEM)
    kv.drain_events()
    written = []
    assert kv.import_blocks([], hashes, tokens, None, lambda ids, rows: written.append((ids, rows))) == (3, 0)
    assert written == [([0, 1, 2], [0, 1, 2])]
    assert kv.pool.num_free_blocks == 8 and all(b.ref_cnt == 0 for b in kv.pool.blocks)  # nothing held
    (ev,) = kv.drain_events()
    assert (ev.kind, ev.block_hashes, ev.parent_hash) == ("stored", tuple(hashes), None)
    assert [b.block_id for b in kv.cached_run(hashes + [123])] == [0, 1, 2]
    seq = Sequence("s", SYSTEM + [1, 2])
    assert admit(kv, seq)[0] == 48
    # again: everything held already, nothing written
    assert kv.import_blocks([], hashes, tokens, None, lambda ids, rows: written.append(ids)) == (0, 3)
    assert len(written) == 1


def test_an_import_continues_a_held_prefix_and_keeps_it_from_eviction():
    kv = KVCacheManager(CacheConfig(block_size=16, num_blocks=4))
    long = SYSTEM + list(range(2000, 2032))  # 5 blocks
    hashes, tokens = _chain(long)
    assert kv.import_blocks([], hashes[:2], tokens[:2], None, lambda ids, rows: None) == (2, 0)
    # 3 more wanted, 4 blocks in all: the 2 held stay (touched), 2 free ones are taken, the fifth does not fit
    assert kv.import_blocks(hashes[:2], hashes[2:], tokens[2:], None, lambda ids, rows: None) == (2, 0)
    assert [b.block_hash for b in kv.cached_run(hashes)] == hashes[:4]
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_an_import_whose_prefix_was_evicted_takes_nothing():
    kv = KVCacheManager(CacheConfig(block_size=16, num_blocks=4))
    hashes, tokens = _chain(SYSTEM)
    assert kv.import_blocks(hashes[:1], hashes[1:], tokens[1:], None, lambda ids, rows: None) == (0, 0)
    assert kv.pool.num_free_blocks == 4 and not kv.pool.cached


def test_a_failed_write_leaks_nothing_and_caches_nothing():
    kv = KVCacheManager(CacheConfig(block_size=16, num_blocks=4))
    hashes, tokens = _chain(SYSTEM)

    def boom(ids, rows):
        raise RuntimeError("bad payload")

    with pytest.raises(RuntimeError):
        kv.import_blocks([], hashes, tokens, None, boom)
    assert kv.pool.num_free_blocks == 4 and not kv.pool.cached

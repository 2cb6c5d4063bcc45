"""Block pool: free queue order, reference counts, lazy eviction and its events, exactly."""

from __future__ import annotations

import pytest

from engine.kv.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from engine.kv.events import KVEventLog


def test_free_queue_pop_remove_append_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.block_ids() == [0, 1, 2, 3, 4] and q.num_free == 5
    q.remove(blocks[2])  # from the middle
    assert q.block_ids() == [0, 1, 3, 4] and q.num_free == 4
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    q.appendleft(blocks[0])
    assert q.block_ids() == [0, 1, 3, 4, 2] and q.num_free == 5
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(blocks[3])
    for _ in range(5):
        q.popleft()
    with pytest.raises(IndexError):
        q.popleft()
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[1])


def test_new_blocks_come_in_id_order_and_refcounts():
    pool = BlockPool(6)
    got = pool.get_new_blocks(4)
    assert [b.block_id for b in got] == [0, 1, 2, 3]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.num_free_blocks == 2 and pool.num_used_blocks == 4 and pool.usage == pytest.approx(4 / 6)
    with pytest.raises(ValueError, match="only 2 free"):
        pool.get_new_blocks(3)
    pool.touch(got[:1])
    assert got[0].ref_cnt == 2
    pool.free_blocks(got[:1])
    assert got[0].ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free_blocks(got[:1])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks(got[:1])


def test_lazy_eviction_lru_order_and_events():
    events = KVEventLog()
    pool = BlockPool(4, events=events)
    a = pool.get_new_blocks(4)
    pool.cache_blocks(a[:3], [10, 11, 12], [(1,), (2,), (3,)], None)
    assert events.drain_events()[0].block_hashes == (10, 11, 12)
    # free tail-first, as the manager does: chain end first
    pool.free_blocks(reversed(a))
    # block 3 has no hash: it goes to the head (nothing can reuse it); the chain's tail next
    assert pool.free_queue.block_ids() == [3, 2, 1, 0]
    assert pool.get_cached_block(10, (1,)) is a[0]  # still cached while free (lazy)
    assert pool.get_cached_block(10, (9,)) is None  # collision guard: tokens differ
    assert pool.get_cached_block(99, (1,)) is None
    got = pool.get_new_blocks(2)
    assert [b.block_id for b in got] == [3, 2]
    assert pool.num_evictions == 1 and 12 not in pool.cached and got[1].block_hash is None
    (ev,) = events.drain_events()
    assert (ev.kind, ev.block_hashes) == ("removed", (12,))
    # a cache hit revives a free block from the middle of the queue
    pool.touch([a[1]])
    assert pool.free_queue.block_ids() == [0] and a[1].ref_cnt == 1
    assert [b.block_id for b in pool.get_new_blocks(1)] == [0]
    assert pool.num_evictions == 2 and sorted(pool.cached) == [11]


def test_duplicate_hash_keeps_first_block_and_events_come_in_runs():
    events = KVEventLog()
    pool = BlockPool(6, events=events)
    first = pool.get_new_blocks(1)
    pool.cache_blocks(first, [21], [(2,)], 20)
    dup = pool.get_new_blocks(3)
    pool.cache_blocks(dup, [20, 21, 22], [(1,), (2,), (3,)], None)
    assert pool.cached[21] is first[0] and dup[1].block_hash is None
    evs = events.drain_events()
    assert [(e.seq, e.kind, e.block_hashes, e.parent_hash) for e in evs] == [
        (1, "stored", (21,), 20), (2, "stored", (20,), None), (3, "stored", (22,), 21)]


def test_reset_prefix_cache_only_when_idle():
    events = KVEventLog()
    pool = BlockPool(2, events=events)
    blocks = pool.get_new_blocks(2)
    pool.cache_blocks(blocks, [1, 2], [(1,), (2,)], None)
    assert pool.reset_prefix_cache() is False
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {} and all(b.block_hash is None for b in blocks)
    assert [e.kind for e in events.drain_events()] == ["stored", "cleared"]


def test_caching_disabled_records_nothing():
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    pool.cache_blocks(blocks, [5], [(1,)], None)
    assert pool.cached == {} and pool.events.drain_events() == []


def test_event_log_sequence_numbers_and_overflow_gap():
    log = KVEventLog(max_pending=2)
    log.stored([1], None)
    log.removed([])  # nothing removed: no event
    log.removed([1])
    log.cleared()
    assert log.last_seq == 3 and log.num_dropped == 1
    assert [e.seq for e in log.drain_events()] == [2, 3]  # event 1 dropped: the gap shows
    assert log.drain_events() == []
    log.stored([7], 3)
    assert [e.seq for e in log.drain_events()] == [4]

"""The exact prefix index fed by KV event sequences, and the approximate LRU index."""

from __future__ import annotations

import pytest

from contract.hashing import DEFAULT_HASH_SEED, hash_blocks
from contract.kv_events import Heartbeat, KVEvent, KVEventKind, Snapshot
from router.routing.approx_index import ApproxPrefixIndex
from router.routing.kv_events import EventApplier
from router.routing.prefix_index import PrefixIndex, request_block_hashes

A, B = "http://a:1", "http://b:1"
BS = 4


def chain(tokens, salt=None):
    return hash_blocks(tokens, BS, salt, DEFAULT_HASH_SEED)


def snapshot(seq, hashes, block_size=BS, seed=DEFAULT_HASH_SEED):
    return Snapshot(seq, block_size, seed, tuple(hashes))


def stored(seq, hashes, parent=None):
    return KVEvent(seq, KVEventKind.STORED, tuple(hashes), parent)


def removed(seq, hashes):
    return KVEvent(seq, KVEventKind.REMOVED, tuple(hashes))


def test_request_hashes_cover_only_cacheable_blocks():
    toks = list(range(9))
    assert request_block_hashes(toks, 4, DEFAULT_HASH_SEED, None) == chain(toks)[:2]
    assert request_block_hashes(toks[:8], 4, DEFAULT_HASH_SEED, None) == chain(toks)[:1]
    # the salt changes every block (it is chained from block 0)
    salted = request_block_hashes(toks, 4, DEFAULT_HASH_SEED, "tenant-a")
    assert salted == chain(toks, "tenant-a")[:2] and not set(salted) & set(chain(toks))


def test_event_sequence_builds_the_index():
    idx = PrefixIndex()
    ap = EventApplier(A, idx)
    toks = list(range(100, 120))  # 5 blocks
    h = chain(toks)
    assert ap.apply(snapshot(10, h[:2]))
    assert idx.params[A] == (BS, DEFAULT_HASH_SEED)
    assert idx.matched_blocks(h, [A, B]) == {A: 2}  # B is not indexed at all
    assert ap.apply(stored(11, h[2:4], parent=h[1]))
    assert idx.matched_blocks(h, [A]) == {A: 4}
    assert ap.apply(Heartbeat(11))
    assert ap.apply(removed(12, [h[1]]))  # a hole: the prefix stops at block 1
    assert idx.matched_blocks(h, [A]) == {A: 1}
    assert ap.apply(KVEvent(13, KVEventKind.CLEARED))
    assert idx.matched_blocks(h, [A]) == {A: 0} and idx.num_blocks(A) == 0
    assert ap.last_seq == 13


def test_two_replicas_share_blocks_and_diverge():
    idx = PrefixIndex()
    sys_prompt = list(range(8))
    conv_a, conv_b = sys_prompt + [50, 51, 52, 53], sys_prompt + [60, 61, 62, 63]
    EventApplier(A, idx).apply(snapshot(1, chain(conv_a)))
    EventApplier(B, idx).apply(snapshot(1, chain(conv_b)))
    assert idx.matched_blocks(chain(conv_a + [1]), [A, B]) == {A: 3, B: 2}
    assert idx.matched_blocks(chain(conv_b + [1]), [A, B]) == {A: 2, B: 3}
    assert idx.matched_blocks(chain([9] * 12), [A, B]) == {A: 0, B: 0}
    idx.drop(A)
    assert idx.matched_blocks(chain(conv_a), [A, B]) == {B: 2}
    assert not idx.has(A)


def test_gaps_and_early_events_ask_for_a_resync():
    idx = PrefixIndex()
    ap = EventApplier(A, idx)
    assert not ap.apply(stored(1, [1]))  # before any snapshot
    assert ap.apply(snapshot(5, []))
    assert not ap.apply(stored(7, [1]))  # 6 is missing
    assert not ap.apply(Heartbeat(6))  # the heartbeat says we missed seq 6
    assert ap.apply(stored(6, [1]))
    assert idx.num_blocks(A) == 1


def test_snapshot_replaces_previous_state():
    idx = PrefixIndex()
    ap = EventApplier(A, idx)
    ap.apply(snapshot(1, [1, 2, 3]))
    ap.apply(snapshot(9, [3, 4]))
    assert idx.num_blocks(A) == 2 and idx.matched_blocks([1], [A]) == {A: 0}
    assert idx.matched_blocks([3, 4], [A]) == {A: 2}


def test_approx_index_is_lru_bounded():
    ap = ApproxPrefixIndex(max_blocks=4)
    ap.record(A, [1, 2, 3])
    ap.record(B, [1, 2, 9])
    assert len(ap) == 4
    assert ap.matched_blocks([1, 2, 3], [A, B]) == {A: 3, B: 2}
    # LRU order is now 3, 1, 2, 9 (B's request touched 1 and 2); recording 1, 5 forgets 3
    ap.record(A, [1, 5])
    assert len(ap) == 4
    assert ap.matched_blocks([1, 2, 3], [A, B]) == {A: 2, B: 2}
    assert ap.matched_blocks([1, 5], [A, B]) == {A: 2, B: 1}
    ap.drop(A)
    assert ap.matched_blocks([1, 5], [A, B]) == {A: 0, B: 1}
    big = ApproxPrefixIndex(max_blocks=1000)
    for i in range(100):
        big.record(A, list(range(i * 50, i * 50 + 50)))
    assert len(big) == 1000
    with pytest.raises(ValueError):
        ApproxPrefixIndex(0)

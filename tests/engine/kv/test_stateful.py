"""Hypothesis stateful test of the KV cache manager against a model of what each block holds.

Random allocate (new sequence, possibly hitting the prefix cache, possibly chunked) / append
(next chunk or a decode token) / fork / free / abort (free mid-prefill) / evict (a large
throwaway sequence) / reset. After every step: each block is free xor referenced, refcounts equal
the number of tables holding it, the free queue has no duplicates, every cached hash maps to a
block whose real contents are its tokens, every sequence reads its own tokens back through its
block table, counters agree with a recount, and a mirror fed only the KV events equals the
snapshot (what a router sees).
"""

from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from contract.hashing import hash_blocks
from engine.kv.config import CacheConfig
from engine.kv.manager import KVCacheManager
from engine.sequence import Sequence

BS = 4
NUM_BLOCKS = 12
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5], []]
_fresh = itertools.count(10_000)


class KVMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(CacheConfig(block_size=BS, num_blocks=NUM_BLOCKS))
        self.content: dict[int, list[int | None]] = {b: [None] * BS for b in range(NUM_BLOCKS)}
        self.seqs: list[Sequence] = []
        self.mirror: set[int] = set()
        self.last_seq = 0
        self.removed_seen = 0

    # ---- helpers -------------------------------------------------------------------------

    def _compute(self, seq: Sequence, n: int, copies: list[tuple[int, int]]) -> None:
        """What the runner does: block copies, then write K/V of the n new tokens, then register."""
        for src, dst in copies:
            self.content[dst] = list(self.content[src])
        for j in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            self.content[seq.block_table[j // BS]][j % BS] = seq.token_ids[j]
        seq.num_computed_tokens += n
        self.kv.cache_full_blocks(seq)

    def _pick(self, i: int) -> Sequence:
        return self.seqs[i % len(self.seqs)]

    # ---- rules ---------------------------------------------------------------------------

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 2), max_size=7),
          salt=st.sampled_from([None, None, "t1"]), chunk=st.integers(1, 24))
    def allocate(self, prefix, tail, salt, chunk):
        seq = Sequence("r", prefix + tail or [0], cache_salt=salt)
        blocks, hit = self.kv.get_computed_blocks(seq)
        assert hit % BS == 0 and hit < seq.num_tokens
        n = min(chunk, seq.num_tokens - hit)
        copies = self.kv.allocate_slots(seq, n, blocks)
        if copies is None:
            assert seq.block_table == [] and seq.num_computed_tokens == 0
            return
        self.kv.record_prefix_query(seq.num_tokens, hit)
        assert seq.num_computed_tokens == hit and copies == []
        self._compute(seq, n, copies)
        self.seqs.append(seq)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100), token=st.integers(0, 2), chunk=st.integers(1, 24))
    def append(self, i, token, chunk):
        seq = self._pick(i)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(token)
        n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        copies = self.kv.allocate_slots(seq, n)
        if copies is None:
            return
        self._compute(seq, n, copies)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def fork(self, i):
        parent = self._pick(i)
        child = Sequence(parent.request_id, parent.token_ids, cache_salt=parent.cache_salt)
        self.kv.fork(parent, child)
        self.seqs.append(child)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        seq = self._pick(i)
        self.kv.free(seq)
        self.seqs.remove(seq)

    @precondition(lambda self: any(s.num_computed_tokens < s.num_tokens for s in self.seqs))
    @rule(i=st.integers(0, 100))
    def abort_mid_prefill(self, i):
        candidates = [s for s in self.seqs if s.num_computed_tokens < s.num_tokens]
        seq = candidates[i % len(candidates)]
        self.kv.free(seq)
        self.kv.free(seq)  # a second abort frees nothing
        self.seqs.remove(seq)

    @rule(n_blocks=st.integers(1, NUM_BLOCKS))
    def evict(self, n_blocks):
        seq = Sequence("evict", [next(_fresh) for _ in range(n_blocks * BS)])
        copies = self.kv.allocate_slots(seq, seq.num_tokens)
        if copies is not None:
            self._compute(seq, seq.num_tokens, copies)
            self.kv.free(seq)

    @rule()
    def reset(self):
        idle = self.kv.pool.num_used_blocks == 0
        assert self.kv.reset_prefix_cache() is idle

    # ---- invariants ----------------------------------------------------------------------

    @invariant()
    def blocks_free_xor_referenced(self):
        pool = self.kv.pool
        free_ids = pool.free_queue.block_ids()
        assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
        holders = Counter(b for s in self.seqs for b in s.block_table)
        for block in pool.blocks:
            assert block.ref_cnt == holders[block.block_id]
            assert (block.ref_cnt == 0) == (block.block_id in set(free_ids))

    @invariant()
    def cache_holds_what_it_claims(self):
        pool = self.kv.pool
        for h, block in pool.cached.items():
            assert block.block_hash == h
            assert block.token_ids == tuple(self.content[block.block_id])
        assert sum(b.block_hash is not None for b in pool.blocks) == len(pool.cached)

    @invariant()
    def sequences_read_their_own_tokens(self):
        for seq in self.seqs:
            assert len(seq.block_table) >= -(-seq.num_computed_tokens // BS)
            for j in range(seq.num_computed_tokens):
                assert self.content[seq.block_table[j // BS]][j % BS] == seq.token_ids[j]
            expect = hash_blocks(seq.token_ids, BS, seq.cache_salt, self.kv.hash_seed)
            assert seq.block_hashes == expect[:len(seq.block_hashes)]

    @invariant()
    def counters_agree_with_a_recount(self):
        used = sum(b.ref_cnt > 0 for b in self.kv.pool.blocks)
        st_ = self.kv.stats()
        assert st_.num_used_blocks == used and st_.num_free_blocks == NUM_BLOCKS - used
        assert st_.usage == used / NUM_BLOCKS and st_.num_cached_blocks == len(self.kv.pool.cached)
        assert 0 <= st_.prefix_hits_tokens <= st_.prefix_queries_tokens

    @invariant()
    def event_mirror_equals_snapshot(self):
        for ev in self.kv.drain_events():
            assert ev.seq == self.last_seq + 1
            self.last_seq = ev.seq
            if ev.kind == "stored":
                assert not self.mirror & set(ev.block_hashes)
                self.mirror |= set(ev.block_hashes)
            elif ev.kind == "removed":
                assert set(ev.block_hashes) <= self.mirror
                self.mirror -= set(ev.block_hashes)
                self.removed_seen += len(ev.block_hashes)
            else:
                self.mirror.clear()
        assert self.mirror == set(self.kv.snapshot())
        assert self.removed_seen == self.kv.evictions


KVMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
TestKVCacheManagerStateful = KVMachine.TestCase

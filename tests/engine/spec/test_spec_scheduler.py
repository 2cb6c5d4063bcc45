"""Drafts in the scheduler and the KV cache: k+1 slots for a decode with k drafts, the rejected slots given back,
only full blocks of kept tokens in the prefix cache, and drafts never worth a preemption. Exact block ids."""

from __future__ import annotations

from engine.config import SchedulerConfig
from engine.kv.config import CacheConfig
from engine.kv.manager import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence


class FixedProposer:
    def __init__(self, drafts):
        self.drafts = list(drafts)
        self.asked = []

    def propose(self, seq, num_running):
        self.asked.append((seq.request_id, num_running))
        return list(self.drafts)

    def finished(self, seq, aborted):
        self.ended = (seq.request_id, aborted)


def setup(num_blocks=16, drafts=(8, 9, 10, 11)):
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=num_blocks, hash_seed=0))
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64, max_step_ms=0), kv)
    sched.proposer = FixedProposer(drafts)
    seq = Sequence("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=20, ignore_eos=True))
    sched.add(seq)
    out = sched.schedule()  # the prompt: no drafts
    assert [(it.num_new_tokens, tuple(it.spec_token_ids)) for it in out.scheduled] == [(6, ())]
    sched.on_step_done(out)
    seq.append_token(7)
    return kv, sched, seq


def verify(sched, out, seq, emitted):
    sched.on_step_done(out)
    for tok in emitted:
        seq.append_token(tok)
    sched.on_drafts_verified(seq, len(emitted) - 1)


def test_a_decode_with_drafts_runs_k_plus_1_slots_and_rejected_slots_are_given_back():
    kv, sched, seq = setup()
    assert seq.block_table == [0, 1] and kv.num_free_blocks == 14
    out = sched.schedule()
    (item,) = out.scheduled
    assert (item.num_new_tokens, list(item.spec_token_ids)) == (5, [8, 9, 10, 11])
    assert out.num_batched_tokens == 5
    assert seq.block_table == [0, 1, 2]  # positions 6..10
    verify(sched, out, seq, [50])  # the first draft rejected: the token sampled in its place
    assert seq.token_ids == [1, 2, 3, 4, 5, 6, 7, 50]
    assert (seq.num_computed_tokens, seq.block_table, kv.num_free_blocks) == (7, [0, 1], 14)
    assert len(kv.pool.cached) == 1  # block 0 only: block 1 holds no kept token beyond 7 yet


def test_accepted_drafts_fill_blocks_that_enter_the_prefix_cache_with_their_tokens():
    kv, sched, seq = setup()
    out = sched.schedule()
    verify(sched, out, seq, [8, 77])  # draft 8 kept, 9 rejected: 77 sampled instead
    assert seq.token_ids[6:] == [7, 8, 77]
    assert (seq.num_computed_tokens, seq.block_table) == (8, [0, 1, 2])  # 77's slot is position 8, in block 2
    assert len(kv.pool.cached) == 2
    block = kv.pool.blocks[1]
    assert block.block_hash == seq.block_hashes[1] and tuple(block.token_ids) == (5, 6, 7, 8)
    # the next decode writes 77 at position 8 and verifies its drafts after it
    out = sched.schedule()
    assert out.scheduled[0].num_new_tokens == 5 and seq.block_table == [0, 1, 2, 3]
    verify(sched, out, seq, [8, 9, 10, 11, 12])  # all kept, plus the bonus token
    assert (seq.num_tokens, seq.num_computed_tokens, seq.block_table) == (14, 13, [0, 1, 2, 3])
    assert len(kv.pool.cached) == 3


def test_every_block_comes_back_when_the_sequence_finishes():
    kv, sched, seq = setup()
    for _ in range(3):
        out = sched.schedule()
        verify(sched, out, seq, [99])
    sched.finish(seq, seq.status.FINISHED_LENGTH)
    assert kv.pool.num_used_blocks == 0 and kv.num_free_blocks == 16


def test_drafts_shrink_to_the_free_blocks_and_never_preempt():
    kv, sched, seq = setup(num_blocks=3)  # prompt holds 2 blocks, 1 free: positions 6..11 at most
    other = Sequence("b", [9], SamplingParams(max_tokens=20))
    sched.proposer.drafts = [8, 9, 10, 11, 12, 13, 14]
    out = sched.schedule()
    assert list(out.scheduled[0].spec_token_ids) == [8, 9, 10, 11, 12]  # 6 slots: 6..11, in blocks 1 and 2
    assert out.preempted == [] and kv.num_free_blocks == 0
    verify(sched, out, seq, [1])
    assert kv.num_free_blocks == 1
    sched.add(other)  # a second sequence takes the last block: no room for drafts, and nobody is preempted
    out = sched.schedule()
    assert [(it.seq.request_id, it.num_new_tokens) for it in out.scheduled] == [("a", 1), ("b", 1)]
    assert out.preempted == []


def test_drafts_take_only_the_budget_the_step_has_left():
    kv, sched, seq = setup()
    sched.config = SchedulerConfig(max_num_batched_tokens=3, max_num_seqs=1, max_model_len=64, max_step_ms=0)
    sched.oom.token_budget = 3
    out = sched.schedule()
    assert (out.scheduled[0].num_new_tokens, list(out.scheduled[0].spec_token_ids)) == (3, [8, 9])


def test_drafts_leave_a_block_for_each_decode_after_them():
    kv, sched, a = setup(num_blocks=5)
    b = Sequence("b", [1] * 8, SamplingParams(max_tokens=20))
    sched.add(b)
    sched.proposer.drafts = []
    out = sched.schedule()  # a decodes (no drafts offered), b's prompt
    sched.on_step_done(out)
    a.append_token(0)
    b.append_token(0)
    assert (a.block_table, b.block_table, kv.num_free_blocks) == ([0, 1], [2, 3], 1)
    sched.proposer.drafts = [8, 9, 10, 11]
    out = sched.schedule()  # a: position 7 is its block's last slot, no draft; b's decode needs the free block,
    # whose other slots take b's drafts
    assert [(it.seq.request_id, list(it.spec_token_ids)) for it in out.scheduled] == [("a", []), ("b", [8, 9, 10])]
    assert out.preempted == [] and b.block_table == [2, 3, 4]


def test_a_step_that_ran_out_of_memory_gives_the_drafts_slots_back():
    kv, sched, seq = setup()
    out = sched.schedule()
    assert seq.block_table == [0, 1, 2]
    sched.on_step_failed(out)
    assert (seq.num_computed_tokens, seq.block_table, kv.num_free_blocks) == (6, [0, 1], 14)
    out = sched.schedule()  # the retry, in half the failed step's tokens: one draft
    assert list(out.scheduled[0].spec_token_ids) == [8] and seq.block_table == [0, 1]

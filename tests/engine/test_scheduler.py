"""Scheduler: token budget, chunked prefill, preemption by recompute, abort, prefix hits, fork."""

from __future__ import annotations

import random

import pytest

from engine.errors import InvalidRequestError, RequestTooLongError
from engine.sampling_params import SamplingParamsError
from engine.sequence import SequenceStatus
from tests.engine.test_scheduler_harness import VOCAB, FakeEngine


def random_trace(seed: int, n: int, max_prompt: int = 40, max_out: int = 12):
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(12)]
    trace = []
    for i in range(n):
        prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, max_prompt))]
        trace.append((f"r{i}", prompt, rng.randint(1, max_out)))
    return trace


def test_budget_never_exceeded_and_the_waiting_queue_drains():
    eng = FakeEngine(num_blocks=40, budget=24, max_num_seqs=4)
    for rid, prompt, max_tokens in random_trace(1, 30):
        eng.add(rid, prompt, max_tokens)
    max_running = 0
    while eng.sched.has_unfinished():
        out = eng.step()
        assert out.num_batched_tokens <= 24
        max_running = max(max_running, eng.sched.num_running)
        assert eng.sched.num_running <= 4
    assert max_running == 4
    assert eng.sched.num_waiting == 0 and eng.sched.num_running == 0
    assert all(s.status is SequenceStatus.FINISHED_LENGTH and s.num_output_tokens == s.params.max_tokens
               for s in eng.seqs)
    assert eng.kv.pool.num_used_blocks == 0 and eng.kv.usage == 0.0


def test_long_prompt_is_chunked_and_mixes_with_decodes():
    eng = FakeEngine(budget=32)
    a = eng.add("a", list(range(10)), max_tokens=20)
    eng.step()  # a's whole prompt
    b = eng.add("b", [7] * 100, max_tokens=2)
    chunks = []
    while b.num_output_tokens == 0:
        out = eng.step()
        assert [i.seq for i in out.scheduled][0] is a  # running first: a's decode, then b's chunk
        chunks.append({i.seq.request_id: i.num_new_tokens for i in out.scheduled})
    assert chunks == [{"a": 1, "b": 31}, {"a": 1, "b": 31}, {"a": 1, "b": 31}, {"a": 1, "b": 7}]
    assert b.num_computed_tokens == 100 and b.num_tokens == 101


def test_running_first_then_waiting_fcfs():
    eng = FakeEngine(budget=10, max_num_seqs=8)
    a = eng.add("a", [1] * 8, max_tokens=5)
    b = eng.add("b", [2] * 8, max_tokens=5)
    c = eng.add("c", [3] * 3, max_tokens=5)
    out = eng.step()
    assert [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled] == [("a", 8), ("b", 2)]
    out = eng.step()  # a decodes, b continues, c (short) must not overtake b
    assert [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled] == [("a", 1), ("b", 6), ("c", 3)]
    assert (a.num_output_tokens, b.num_output_tokens, c.num_output_tokens) == (2, 1, 1)


def test_max_num_seqs_caps_admission():
    eng = FakeEngine(budget=64, max_num_seqs=2)
    for i in range(3):
        eng.add(f"r{i}", [i + 1] * 4, max_tokens=3)
    out = eng.step()
    assert [i.seq.request_id for i in out.scheduled] == ["r0", "r1"] and eng.sched.num_waiting == 1


def test_preemption_under_a_tiny_pool_gives_the_same_tokens():
    trace = random_trace(7, 12, max_prompt=30, max_out=16)
    reference = FakeEngine(num_blocks=200, budget=32, max_num_seqs=8)
    tiny = FakeEngine(num_blocks=14, budget=32, max_num_seqs=8)
    no_cache = FakeEngine(num_blocks=14, budget=32, max_num_seqs=8, prefix_caching=False)
    for eng in (reference, tiny, no_cache):
        for rid, prompt, max_tokens in trace:
            eng.add(rid, prompt, max_tokens)
        eng.run()
    assert reference.sched.num_preemptions == 0
    assert tiny.sched.num_preemptions > 0 and no_cache.sched.num_preemptions > 0
    assert tiny.outputs_by_seq() == reference.outputs_by_seq() == no_cache.outputs_by_seq()
    assert all(len(v) == mt for v, (_, _, mt) in zip(reference.outputs_by_seq().values(), trace, strict=True))
    assert tiny.kv.alloc_failures > 0 and tiny.kv.pool.num_used_blocks == 0


def test_preempts_the_newest_and_admits_nothing_new_that_step():
    eng = FakeEngine(num_blocks=4, block_size=4, budget=64)
    a = eng.add("a", [1] * 8, max_tokens=3)
    b = eng.add("b", [2] * 8, max_tokens=3)
    eng.step()
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    c = eng.add("c", [3], max_tokens=1)
    out = eng.step()  # a and b each need a third block; none is free
    assert out.preempted == [b] and [i.seq for i in out.scheduled] == [a]
    assert list(eng.sched.waiting) == [b, c] and b.num_preemptions == 1
    # b was freed tail-first, so a gets b's last block (evicting its hash); b's first block stays cached
    assert a.block_table == [0, 1, 3] and eng.kv.evictions == 1 and eng.kv.stats().preemptions == 1
    out = eng.step()  # b cannot come back yet (needs 3 blocks, 1 free): a runs alone, nothing admitted
    assert [i.seq for i in out.scheduled] == [a] and out.preempted == []
    eng.run()
    assert a.output_token_ids == [8, 16, 32] and b.output_token_ids == [16, 32, 64] and c.output_token_ids == [3]
    assert b.num_cached_tokens == 0 and eng.kv.prefix_hits_tokens == 4  # b's surviving first block


def test_abort_in_every_state_frees_every_block_once():
    eng = FakeEngine(num_blocks=24, budget=8)
    dec = eng.add("dec", [1] * 5, max_tokens=50)
    eng.step()
    eng.step()  # dec is decoding
    mid = eng.add("mid", [2] * 30, max_tokens=5)
    eng.step()  # mid is mid-prefill
    wait = eng.add("wait", [3] * 5, max_tokens=5)
    assert dec.num_output_tokens == 3 and 0 < mid.num_computed_tokens < 30 and wait.status is SequenceStatus.WAITING
    assert eng.kv.pool.num_used_blocks > 0
    for rid, seq in (("wait", wait), ("mid", mid), ("dec", dec)):
        assert eng.sched.abort(rid) == [seq]
        assert seq.status is SequenceStatus.FINISHED_ABORTED and seq.block_table == []
        assert eng.sched.abort(rid) == []
        eng.check_blocks()
    assert eng.kv.pool.num_used_blocks == 0 and not eng.sched.has_unfinished()
    assert eng.sched.abort("never-seen") == []


def test_abort_while_the_step_runs_is_safe():
    eng = FakeEngine(num_blocks=12, budget=8)
    a = eng.add("a", [1] * 20, max_tokens=5)
    out = eng.sched.schedule()
    eng.sched.abort("a")
    eng.sched.on_step_done(out)  # the engine reports the step after the abort
    assert a.num_computed_tokens == 0 and eng.kv.pool.num_used_blocks == 0 and eng.kv.snapshot() == []


def test_second_request_reports_48_cached_tokens():
    eng = FakeEngine(num_blocks=20, block_size=16, budget=256)
    system = list(range(48))
    a = eng.add("a", system + [1, 2, 3], max_tokens=2)
    eng.run()
    b = eng.add("b", system + [4, 5], max_tokens=2)
    out = eng.step()
    assert out.scheduled[0].num_new_tokens == 2 and b.num_cached_tokens == 48 and a.num_cached_tokens == 0
    assert b.block_table[:3] == [0, 1, 2]
    assert (eng.kv.prefix_queries_tokens, eng.kv.prefix_hits_tokens) == (51 + 50, 48)


def test_cache_salt_isolates_tenants():
    eng = FakeEngine(num_blocks=40, block_size=16, budget=256)
    prompt = list(range(40))
    hits = {}
    for rid, salt in (("a", "t1"), ("b", "t2"), ("c", None), ("d", "t1")):
        seq = eng.add(rid, prompt, max_tokens=1, cache_salt=salt)
        eng.run()
        hits[rid] = seq.num_cached_tokens
    assert hits == {"a": 0, "b": 0, "c": 0, "d": 32}


def test_fork_shares_blocks_and_copies_on_write():
    eng = FakeEngine(num_blocks=20, block_size=16, budget=256)
    parent = eng.add("p", list(range(20)), max_tokens=3, n=3)
    eng.step()  # prefill, then the harness forks two children and samples for all three
    kids = eng.sched.get_seqs("p")
    assert [s.index for s in kids] == [0, 1, 2] and eng.sched.num_running == 3
    assert all(s.block_table == [0, 1] for s in kids) and eng.kv.pool.num_used_blocks == 2
    out = eng.step()
    # in running order, the parent and the first child copy; the last holder writes in place
    assert out.blocks_to_copy == [(1, 2), (1, 3)]
    assert [s.block_table for s in kids] == [[0, 2], [0, 3], [0, 1]]
    assert eng.kv.pool.num_used_blocks == 4
    eng.run()
    outs = [s.output_token_ids for s in kids]
    assert outs[0][0] == sum(range(20)) % VOCAB and outs[1][0] == (sum(range(20)) + 1) % VOCAB
    assert len({tuple(o) for o in outs}) == 3 and eng.kv.pool.num_used_blocks == 0
    assert eng.sched.abort("p") == [] and parent.status is SequenceStatus.FINISHED_LENGTH


def test_abort_of_a_forked_request_frees_all_children():
    eng = FakeEngine(num_blocks=20, block_size=16, budget=256)
    eng.add("p", list(range(20)), max_tokens=10, n=4)
    eng.step()
    eng.step()
    assert eng.kv.pool.num_used_blocks == 5
    assert len(eng.sched.abort("p")) == 4
    assert eng.kv.pool.num_used_blocks == 0


def test_rejects_requests_that_can_never_fit():
    eng = FakeEngine(num_blocks=8, block_size=4, max_model_len=64, max_num_seqs=4)
    with pytest.raises(RequestTooLongError, match=r"maximum context length is 64 tokens. However, you requested 65 tokens"):
        eng.add("a", [1] * 60, max_tokens=5)
    with pytest.raises(RequestTooLongError, match=r"needs up to 40 KV slots \(10 blocks of 4\).*only 8 blocks"):
        eng.add("b", [1] * 30, max_tokens=11)
    with pytest.raises(RequestTooLongError, match="no room for output"):
        eng.add("c", [1] * 64, max_tokens=None)
    with pytest.raises(InvalidRequestError, match="at least one token"):
        eng.add("d", [], max_tokens=1)
    with pytest.raises(SamplingParamsError, match="max_num_seqs") as exc:
        eng.add("e", [1], max_tokens=1, n=5)
    assert exc.value.param == "n"
    eng.add("f", [1] * 30, max_tokens=3)  # 32 slots = 8 blocks: fits exactly
    assert eng.sched.num_waiting == 1
    eng.run()


def test_finish_needs_a_finished_status():
    eng = FakeEngine()
    seq = eng.add("a", [1, 2], max_tokens=1)
    with pytest.raises(ValueError, match="finished status"):
        eng.sched.finish(seq, SequenceStatus.RUNNING)


def test_a_request_with_n_sequences_is_admitted_only_with_room_for_all():
    eng = FakeEngine(budget=64, max_num_seqs=4)
    eng.add("a", [1] * 4, max_tokens=5)
    eng.add("b", [2] * 4, max_tokens=5, n=3)
    eng.add("c", [3] * 4, max_tokens=5)
    out = eng.step()
    # b takes 3 of the 4 running slots (it forks after its prompt), so c waits
    assert [i.seq.request_id for i in out.scheduled] == ["a", "b"] and eng.sched.num_running == 4
    assert eng.sched.num_waiting == 1
    eng.run()
    assert all(s.num_output_tokens == 5 for s in eng.seqs) and len(eng.seqs) == 5


def test_a_long_prefill_never_starves_later_decodes():
    eng = FakeEngine(num_blocks=80, budget=16, max_num_seqs=4)
    p = eng.add("p", [1] * 4, max_tokens=30, n=2)
    b = eng.add("b", [2] * 60, max_tokens=2)  # admitted with the budget p left: a long prefill
    out = eng.step()  # p's prompt + b's first chunk; then p forks: its child runs behind b
    assert [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled] == [("p", 4), ("b", 12)]
    child = eng.sched.running[-1]
    assert child.index == 1 and eng.sched.running == [p, b, child]
    for _ in range(3):
        out = eng.step()
        assert [(i.seq.request_id, i.seq.index, i.num_new_tokens) for i in out.scheduled] == [
            ("p", 0, 1), ("b", 0, 14), ("p", 1, 1)]
    assert child.num_output_tokens == 4 and b.num_computed_tokens == 12 + 3 * 14


def test_requests_arriving_with_the_same_new_prefix_compute_it_once():
    """a, b and c share a 24-token prefix nobody holds; d does not. With a budget of 16, a computes the prefix in
    chunks while b and c wait for it (d, behind them, goes first), then both find it cached."""
    eng = FakeEngine(block_size=4, budget=16, max_num_seqs=8)
    prefix = list(range(50, 74))  # 6 blocks
    a = eng.add("a", prefix + [1, 2], max_tokens=2)
    b = eng.add("b", prefix + [3, 4, 5], max_tokens=2)
    c = eng.add("c", prefix + [6], max_tokens=2)
    d = eng.add("d", [9] * 6, max_tokens=2)
    steps = [{i.seq.request_id: i.num_new_tokens for i in eng.step().scheduled} for _ in range(4)]
    assert steps[:2] == [{"a": 16}, {"a": 10, "d": 6}]  # b and c wait while a computes the blocks they need next
    assert steps[2:] == [{"a": 1, "d": 1, "b": 3, "c": 1},  # then only their own tokens: 24 prefix tokens cached
                         {"b": 1, "c": 1}]
    assert (b.num_cached_tokens, c.num_cached_tokens) == (24, 24)
    assert all(s.num_output_tokens == 2 for s in (a, b, c, d)) and eng.kv.pool.num_used_blocks == 0


def test_a_request_waiting_for_a_prefix_goes_on_when_its_prefill_is_aborted():
    eng = FakeEngine(block_size=4, budget=16, max_num_seqs=8)
    prefix = list(range(50, 74))
    eng.add("a", prefix + [1, 2], max_tokens=2)
    b = eng.add("b", prefix + [3], max_tokens=2)
    assert {i.seq.request_id: i.num_new_tokens for i in eng.step().scheduled} == {"a": 16}
    eng.sched.abort("a")
    assert {i.seq.request_id: i.num_new_tokens for i in eng.step().scheduled} == {"b": 9}  # a's 16 cached stay hits
    assert b.num_cached_tokens == 16

"""Random workloads (prefix sharing, n > 1, aborts at random steps) under random pool sizes and
budgets: after every step refcounts match the block tables and the budget holds; every request
that was not aborted gets exactly the tokens it gets on a huge pool with nobody aborted."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.test_scheduler_harness import VOCAB, FakeEngine


def make_trace(seed: int, n: int):
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(9)]
    return [(f"r{i}", (shared if rng.random() < 0.5 else []) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))],
             rng.randint(1, 10), rng.choice([1, 1, 1, 2, 3])) for i in range(n)]


def run(trace, num_blocks, budget, max_num_seqs, aborts, prefix_caching=True, policy="fcfs", seed=0):
    eng = FakeEngine(num_blocks=num_blocks, budget=budget, max_num_seqs=max_num_seqs,
                     prefix_caching=prefix_caching, policy=policy, aging_s=3.0)
    rng = random.Random(seed)
    pending = list(trace)
    step = 0
    while pending or eng.sched.has_unfinished():
        eng.now = float(step)  # one second per step: aging lifts a waiting request every 3 steps
        if pending:  # requests arrive over time: two per step
            for rid, prompt, max_tokens, n in pending[:2]:
                eng.add(rid, prompt, max_tokens, n, priority=rng.randint(-2, 2) if policy == "priority" else 0)
            del pending[:2]
        for rid in aborts.get(step, ()):
            for seq in eng.sched.abort(rid):
                assert seq.block_table == []
        eng.step()
        step += 1
        assert step < 5000
    assert eng.kv.pool.num_used_blocks == 0 and eng.sched.num_waiting == 0
    return eng


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), num_blocks=st.integers(10, 40), budget=st.integers(8, 48),
       max_num_seqs=st.integers(1, 8), prefix_caching=st.booleans(),
       abort_plan=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 11)), max_size=4),
       policy=st.sampled_from(["fcfs", "priority"]))
def test_random_workloads_complete_with_reference_tokens(seed, num_blocks, budget, max_num_seqs, prefix_caching,
                                                         abort_plan, policy):
    max_num_seqs = min(max_num_seqs, budget)
    trace = make_trace(seed, 12)
    aborts: dict[int, list[str]] = {}
    for step, i in abort_plan:
        aborts.setdefault(step, []).append(f"r{i}")
    reference = run(trace, 400, 64, 8, {}).outputs_by_seq()
    eng = run(trace, num_blocks, budget, max(max_num_seqs, 3), aborts, prefix_caching, policy, seed)
    aborted = {rid for rids in aborts.values() for rid in rids}
    got = eng.outputs_by_seq()
    for (rid, index), tokens in reference.items():
        if rid not in aborted:
            assert got[(rid, index)] == tokens
    for seq in eng.seqs:
        assert seq.is_finished
        if seq.status.value == "abort":
            assert seq.num_output_tokens <= seq.params.max_tokens

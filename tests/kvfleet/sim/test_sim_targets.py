"""Latency targets in the simulated engine (kvfleet/sim/engine.py), as the engine keeps them: prefill earliest due
first, a missed TTFT target best effort, and steps cut for the strictest TPOT target."""

from __future__ import annotations

import pytest

from kvfleet.sim.cost import CostModel
from kvfleet.sim.engine import BEST_EFFORT_TARGETS, MIN_CHUNK_TOKENS, SimEngine, SimSeq

COST = CostModel(base_s=0.01, prefill_token_s=0.001, decode_seq_s=0.002)


def chunks(eng: SimEngine) -> list[tuple[int, int]]:
    assert eng.plan is not None
    return [(s.rid, n) for s, n in eng.plan.chunks]


def test_the_due_time_is_arrival_plus_target_then_best_effort():
    s = SimSeq(0, (), 8, 1, 2.0, ttft_target=1.0)
    assert s.due(2.5) == 3.0 and s.due(3.0) == 3.0
    assert s.due(3.1) == 2.0 + BEST_EFFORT_TARGETS * 1.0
    assert SimSeq(1, (), 8, 1, 2.0).due(2.5) == float("inf")


def test_prefill_goes_earliest_due_first_and_a_missed_target_after_a_live_one():
    eng = SimEngine("e", num_blocks=64, block_size=4, cost=COST, max_batched_tokens=8)
    missed = SimSeq(0, (), 8, 1, 0.0, ttft_target=0.5)
    late = SimSeq(1, (), 8, 1, 0.9, ttft_target=2.0)  # due 2.9
    soon = SimSeq(2, (), 8, 1, 1.0, ttft_target=1.0)  # due 2.0
    for s in (missed, late, soon):
        eng.waiting.append(s)
    eng.start(1.0)  # missed is due at 10.0 now
    assert [s.rid for s in eng.running] == [2, 1, 0]
    assert chunks(eng) == [(2, 8)]


def test_without_targets_prefill_stays_in_arrival_order():
    eng = SimEngine("e", num_blocks=64, block_size=4, cost=COST, max_batched_tokens=8)
    for k in range(3):
        eng.waiting.append(SimSeq(k, (), 8, 1, 1.0 - 0.1 * k))
    eng.start(1.0)
    assert chunks(eng) == [(0, 8)]


def _decoding_beside_a_prompt(tpot_target: float) -> SimEngine:
    """One sequence decoding (its prompt done) with the TPOT target, a 1,000-token prompt waiting."""
    eng = SimEngine("e", num_blocks=512, block_size=4, cost=COST, max_batched_tokens=2048)
    eng.add(SimSeq(0, (), 4, 50, 0.0, tpot_target=tpot_target), 0.0)
    eng.finish(eng.plan.dt)
    assert eng.running[0].computed == 4
    eng.waiting.append(SimSeq(1, (), 1000, 1, 0.1))
    eng.start(0.1)
    return eng


def test_a_tpot_target_cuts_the_steps_prefill_to_its_margin():
    eng = _decoding_beside_a_prompt(0.05)
    # 0.9 x 50 ms = 45 ms; a step with one decode costs 10 + 2 ms: 33 ms left at 1 ms a prompt token
    assert chunks(eng) == [(1, 33)] and eng.plan.dt == pytest.approx(0.045)
    assert chunks(_decoding_beside_a_prompt(0.01)) == [(1, MIN_CHUNK_TOKENS)]  # no room: the prompt still progresses


def test_a_prompt_still_computing_has_no_token_to_pace_so_its_tpot_target_cuts_no_step():
    eng = SimEngine("e", num_blocks=2048, block_size=4, cost=COST, max_batched_tokens=2048)
    eng.waiting.append(SimSeq(0, (), 1000, 5, 0.0, tpot_target=0.05))
    eng.waiting.append(SimSeq(1, (), 600, 5, 0.0, tpot_target=0.05))
    eng.start(0.0)
    assert chunks(eng) == [(0, 1000), (1, 600)]  # both whole: nobody decodes yet
    eng.finish(eng.plan.dt)
    eng.waiting.append(SimSeq(2, (), 1000, 1, 1.7))
    eng.start(1.7)
    # now two decode with the 50 ms target: 45 ms - (10 + 2 x 2) ms leaves 31 prompt tokens
    assert chunks(eng) == [(2, 31)]

"""The draft model's gate (engine/spec/draft_gate.py): exact speed-ups, closing, probes doubling, reopening."""

from __future__ import annotations

import pytest

from engine.spec.draft_gate import MAX_PROBE_EVERY, MIN_PROBE_EVERY, DraftGate, undrafted
from engine.step_time import StepShape


def steps_until_allowed(gate: DraftGate) -> int:
    n = 1
    while not gate.allow():
        n += 1
    return n


def test_the_speedup_is_tokens_per_second_against_the_step_without_drafts():
    gate = DraftGate()
    assert gate.open and gate.speedup is None and gate.allow()
    gate.observe(draft_s=0.010, step_s=0.030, decoding=2, accepted=4)  # (1 + 4/2) * 30 / 40
    assert gate.speedup == pytest.approx(2.25) and gate.open
    gate.observe(draft_s=0.030, step_s=0.010, decoding=4, accepted=0)  # r = 0.25: 2.25 + (0.25 - 2.25) / 4
    assert gate.speedup == pytest.approx(1.75) and gate.open


def test_it_closes_below_one_probes_with_doubling_intervals_and_reopens():
    gate = DraftGate()
    gate.observe(draft_s=0.040, step_s=0.010, decoding=1, accepted=0)  # r = 0.2
    assert not gate.open and gate.speedup == pytest.approx(0.2)
    assert steps_until_allowed(gate) == MIN_PROBE_EVERY
    assert gate.num_closed_steps == MIN_PROBE_EVERY - 1
    gate.observe(draft_s=0.040, step_s=0.010, decoding=1, accepted=0)
    assert not gate.open and gate.probe_every == 2 * MIN_PROBE_EVERY
    assert steps_until_allowed(gate) == 2 * MIN_PROBE_EVERY
    for _ in range(10):
        gate.observe(draft_s=0.040, step_s=0.010, decoding=1, accepted=0)
    assert gate.probe_every == MAX_PROBE_EVERY
    gate.observe(draft_s=0.010, step_s=0.010, decoding=1, accepted=4)  # r = 2.5: 0.2 + (2.5 - 0.2) / 2 = 1.35
    assert gate.open and gate.speedup == pytest.approx(1.35) and gate.probe_every == MIN_PROBE_EVERY
    assert all(gate.allow() for _ in range(5))


def test_steps_without_decodes_teach_it_nothing():
    gate = DraftGate()
    gate.observe(draft_s=0.010, step_s=0.010, decoding=0, accepted=0)
    gate.observe(draft_s=0.010, step_s=0.0, decoding=3, accepted=1)
    assert gate.speedup is None and gate.open


def test_the_step_without_drafts_is_the_baseline_where_the_step_time_model_knows_it():
    gate = DraftGate()
    # 16 decoding, 20 drafts kept: 2.25x the tokens, but the verifying step took 50 ms where 20 ms without drafts
    gate.observe(draft_s=0.040, step_s=0.050, decoding=16, accepted=20, undrafted_s=0.020)  # 2.25 * 20 / 90
    assert gate.speedup == pytest.approx(0.5) and not gate.open


def test_a_steps_shape_without_its_drafts():
    # two sequences verified 4 and 2 drafts (5 + 3 rows), one decoded, a 10-token prompt chunk
    shape = StepShape(prefill_tokens=18, decode_seqs=1, context_tokens=400)
    assert undrafted(shape, [4, 0, 2]) == StepShape(10, 3, 394)

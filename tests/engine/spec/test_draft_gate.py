"""The draft model's gate (engine/spec/draft_gate.py): exact speed-ups, closing, probes doubling, reopening."""

from __future__ import annotations

import pytest

from engine.spec.draft_gate import MAX_PROBE_EVERY, MIN_PROBE_EVERY, DraftGate


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

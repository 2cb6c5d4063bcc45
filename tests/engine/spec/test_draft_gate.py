"""The speculation gate (engine/spec/draft_gate.py): the baseline from plain steps, exact speed-ups, control
steps, closing, probes doubling, reopening, a verdict per class of batch sizes."""

from __future__ import annotations

import pytest

from engine.spec.draft_gate import (
    CONTROL_EVERY,
    CONTROL_EVERY_SURE,
    MAX_PROBE_EVERY,
    MIN_PROBE_EVERY,
    REOPEN,
    SURE,
    DraftGate,
    batch_class,
    undrafted,
)
from engine.step_time import StepShape


def steps_until_allowed(gate: DraftGate, decoding: int = 1) -> int:
    n = 1
    while not gate.allow(decoding):
        n += 1
    return n


def test_the_baseline_is_a_line_through_plain_decode_steps():
    gate = DraftGate()
    assert gate.baseline(4) is None
    gate.observe_plain(0.020, 4)
    gate.observe_plain(0.024, 4)
    assert gate.baseline(16) == pytest.approx(0.022)  # one B seen: their mean
    gate.observe_plain(0.046, 16)
    gate.observe_plain(0.046, 16)
    assert gate.baseline(8) == pytest.approx(0.030)  # 0.014 + 0.002 * B
    gate.observe_plain(0.0, 3)  # nothing learnt from an empty step
    gate.observe_plain(0.010, 0)
    assert gate.baseline(8) == pytest.approx(0.030)


def test_it_learns_nothing_before_a_baseline_and_measures_one_first():
    gate = DraftGate()
    assert not gate.allow(2)  # no plain step yet: a control step
    gate.observe(draft_s=0.010, step_s=0.030, decoding=2, accepted=4)
    assert gate.speedup is None and gate.open
    gate.observe_plain(0.020, 2)
    assert gate.allow(2)


def test_the_speedup_is_tokens_per_second_against_the_step_without_drafts():
    gate = DraftGate()
    gate.observe_plain(0.020, 16)
    # 16 decoding kept 20 drafts: 2.25x the tokens, in 40 ms of draft + 50 ms of verifying step against 20 ms
    gate.observe(draft_s=0.040, step_s=0.050, decoding=16, accepted=20)
    assert gate.speedup == pytest.approx(0.5) and not gate.open
    gate = DraftGate()
    gate.observe_plain(0.030, 2)
    gate.observe(draft_s=0.010, step_s=0.030, decoding=2, accepted=4)  # (1 + 4/2) * 30 / 40
    assert gate.speedup == pytest.approx(2.25) and gate.open
    gate.observe(draft_s=0.030, step_s=0.030, decoding=3, accepted=0)  # r = 0.5 (B = 2-3: one class): 2.25 + (0.5 - 2.25) / 4
    assert gate.speedup == pytest.approx(1.8125) and gate.open


def test_open_it_drafts_but_for_one_control_step_in_each_run():
    gate = DraftGate()
    gate.observe_plain(0.030, 2)
    allowed = [gate.allow(2) for _ in range(3 * CONTROL_EVERY)]
    assert allowed.count(False) == 3 and allowed[CONTROL_EVERY - 1] is False


def test_it_closes_below_one_probes_with_doubling_intervals_and_reopens():
    gate = DraftGate()
    gate.observe_plain(0.010, 1)
    gate.observe(draft_s=0.040, step_s=0.010, decoding=1, accepted=0)  # r = 0.2
    assert not gate.open and gate.speedup == pytest.approx(0.2)
    assert steps_until_allowed(gate) == MIN_PROBE_EVERY
    assert gate.num_closed_steps == MIN_PROBE_EVERY - 1
    gate.observe(draft_s=0.040, step_s=0.010, decoding=1, accepted=0)
    assert not gate.open and gate.current.probe_every == 2 * MIN_PROBE_EVERY
    assert steps_until_allowed(gate) == 2 * MIN_PROBE_EVERY
    for _ in range(10):
        gate.observe(draft_s=0.040, step_s=0.010, decoding=1, accepted=0)
    assert gate.current.probe_every == MAX_PROBE_EVERY
    gate.observe(draft_s=0.010, step_s=0.010, decoding=1, accepted=4)  # r = 2.5: 0.2 + (2.5 - 0.2) / 2 = 1.35
    assert gate.open and gate.speedup == pytest.approx(1.35) and gate.current.probe_every == MIN_PROBE_EVERY
    assert all(gate.allow(1) for _ in range(CONTROL_EVERY - 1))


def test_a_steps_shape_without_its_drafts():
    # two sequences verified 4 and 2 drafts (5 + 3 rows), one decoded, a 10-token prompt chunk
    shape = StepShape(prefill_tokens=18, decode_seqs=1, context_tokens=400)
    assert undrafted(shape, [4, 0, 2]) == StepShape(10, 3, 394)


def test_control_steps_thin_out_while_drafting_pays_well():
    gate = DraftGate()
    gate.observe_plain(0.010, 1)
    gate.observe(draft_s=0.0, step_s=0.011, decoding=1, accepted=1)  # r = 2 * 10 / 11 = 1.82: at least SURE
    assert gate.speedup >= SURE
    allowed = [gate.allow(1) for _ in range(2 * CONTROL_EVERY_SURE)]
    assert allowed.count(False) == 2 and allowed[CONTROL_EVERY_SURE - 1] is False
    gate.observe(draft_s=0.0, step_s=0.020, decoding=1, accepted=0)  # r = 0.5: 1.82 + (0.5 - 1.82) / 4 < SURE
    assert 1 < gate.speedup < SURE
    allowed = [gate.allow(1) for _ in range(2 * CONTROL_EVERY)]
    assert allowed.count(False) == 2 and allowed[CONTROL_EVERY - 1] is False


def test_closed_it_reopens_only_clear_of_break_even():
    gate = DraftGate()
    gate.observe_plain(0.010, 1)
    gate.observe(draft_s=0.0, step_s=0.0110, decoding=1, accepted=0)  # r = 0.91: closed
    assert not gate.open
    gate.observe(draft_s=0.0, step_s=0.0083, decoding=1, accepted=0)  # r = 1.20: 0.91 + (1.20 - 0.91) / 2 = 1.06
    assert not gate.open and 1 < gate.speedup < REOPEN and gate.current.probe_every == 2 * MIN_PROBE_EVERY
    gate.observe(draft_s=0.0, step_s=0.0080, decoding=1, accepted=0)  # r = 1.25: 1.06 + (1.25 - 1.06) / 2 = 1.15
    assert gate.open and gate.speedup >= REOPEN and gate.current.probe_every == MIN_PROBE_EVERY


def test_batch_sizes_fall_in_classes_of_doubling_sizes():
    assert [batch_class(b) for b in (0, 1, 2, 3, 4, 7, 8, 15, 16, 63, 64)] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 6, 7]


def test_a_class_closed_on_a_full_batch_leaves_a_lone_sequence_drafting():
    """Drafts that cost more than they save at 16 sequences close the gate for steps of 16-31, not for one
    sequence alone, which keeps its own verdict (and a batch of 16 again finds its class still closed)."""
    gate = DraftGate()
    gate.observe_plain(0.010, 1)
    gate.observe_plain(0.040, 16)  # baseline 0.008 + 0.002 * B
    gate.observe(draft_s=0.0, step_s=0.060, decoding=16, accepted=4)  # r = 1.25 * 0.040 / 0.060 = 0.83
    assert not gate.open and gate.speedup == pytest.approx(0.8333, abs=1e-4)
    assert not gate.allow(16) and not gate.allow(20) and gate.num_closed_steps == 2
    assert gate.allow(1) and gate.open and gate.speedup is None  # one sequence: its class never drafted yet
    gate.observe(draft_s=0.0, step_s=0.012, decoding=1, accepted=2)  # r = 3 * 0.010 / 0.012 = 2.5
    assert gate.open and gate.speedup == pytest.approx(2.5)
    assert not gate.allow(31) and not gate.open and gate.num_closed_steps == 3
    assert steps_until_allowed(gate, 16) == MIN_PROBE_EVERY - 3  # its probe: due on its own class's count
    assert gate.verdict(1).open and gate.verdict(1).speedup == pytest.approx(2.5)

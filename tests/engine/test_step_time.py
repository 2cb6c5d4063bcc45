"""The step-time model (engine/step_time.py): least squares on hand-made steps, the prompt tokens a target allows."""

from __future__ import annotations

import pytest

from engine.step_time import StepShape, StepTimeModel, fit

TRUE = (0.02, 0.0003, 0.001, 0.00001)  # c0 s, s per prompt token, s per decoding sequence, s per context token


def seconds(shape: StepShape, c=TRUE) -> float:
    return c[0] + c[1] * shape.prefill_tokens + c[2] * shape.decode_seqs + c[3] * shape.context_tokens


def shapes(n: int) -> list[StepShape]:
    """Varied steps: prompt chunks 0..2048, 0..30 decodes, their contexts."""
    out = []
    for i in range(n):
        prefill = (i * 397) % 2049 if i % 3 else 0
        decodes = (i * 7) % 31
        out.append(StepShape(prefill, decodes, prefill + decodes * (100 + (i * 53) % 700)))
    return out


def test_the_fit_recovers_the_coefficients_of_exact_steps():
    m = StepTimeModel(min_samples=32)
    for s in shapes(64):
        m.observe(s, seconds(s))
    assert m.coefficients == pytest.approx(TRUE, rel=1e-9, abs=1e-12)
    assert m.predict(StepShape(1000, 10, 5000)) == pytest.approx(0.02 + 0.3 + 0.01 + 0.05)


def test_not_ready_until_min_samples_then_ready():
    m = StepTimeModel(min_samples=32)
    for s in shapes(31):
        m.observe(s, seconds(s))
    assert not m.ready and m.predict(StepShape(1, 1, 1)) is None and m.max_prefill_tokens(0.1, 0, 0) is None
    m.observe(StepShape(512, 3, 900), seconds(StepShape(512, 3, 900)))
    assert m.ready


def test_max_prefill_tokens_keeps_the_predicted_step_under_the_target():
    m = StepTimeModel()
    m.coefficients = (0.01, 0.001, 0.002, 0.00001)
    # 0.15 - (0.01 + 4 * 0.002 + 2000 * 0.00001) = 0.112 s of room; a prompt token costs 0.001 + 0.00001
    assert m.max_prefill_tokens(0.150, 4, 2000) == 110  # floor(0.112 / 0.00101) = floor(110.89)
    assert m.predict(StepShape(110, 4, 2110)) <= 0.150 < m.predict(StepShape(111, 4, 2111))
    assert m.max_prefill_tokens(0.010, 4, 2000) == 0  # the decodes alone are over it


def test_a_negative_coefficient_is_dropped_and_the_rest_refitted():
    # each prompt size twice, with 0 and 2 decodes, the step 4 ms *shorter* with the decodes: the unconstrained
    # fit gives decodes -2 ms each; dropped, the least squares line through each pair's mean remains
    samples = []
    for p in (0, 100, 200, 400, 800):
        samples.append((p, 0, 0, 0.010 + 0.001 * p))
        samples.append((p, 2, 0, 0.006 + 0.001 * p))
    c0, c1, c2, c3 = fit(samples)
    assert (c0, c1, c2, c3) == pytest.approx((0.008, 0.001, 0.0, 0.0), abs=1e-12)


def test_no_bound_when_prompt_tokens_do_not_cost_time():
    samples = [(p, 1, 10, 0.05 - 0.00001 * p) for p in range(0, 1000, 10)]  # longer prompts, shorter steps
    assert fit(samples) is None
    m = StepTimeModel(min_samples=4)
    for p, d, c, t in samples:
        m.observe(StepShape(p, d, c), t)
    assert not m.ready


def test_the_window_follows_the_latest_steps():
    m = StepTimeModel(window=64, min_samples=32, refit_every=1)
    slow = (0.04, 0.0006, 0.002, 0.00002)
    for s in shapes(64):
        m.observe(s, seconds(s, slow))
    assert m.coefficients == pytest.approx(slow, rel=1e-9, abs=1e-12)
    for s in shapes(64):
        m.observe(s, seconds(s))
    assert m.coefficients == pytest.approx(TRUE, rel=1e-9, abs=1e-12)


def test_it_refits_every_refit_every_steps():
    m = StepTimeModel(window=64, min_samples=8, refit_every=4)
    steps = shapes(12)
    for s in steps[:8]:
        m.observe(s, seconds(s))
    first = m.coefficients
    for s in steps[8:11]:
        m.observe(s, seconds(s, (0.1, 0.001, 0.01, 0.0001)))
    assert m.coefficients == first  # 3 new steps: not yet
    m.observe(steps[11], seconds(steps[11], (0.1, 0.001, 0.01, 0.0001)))
    assert m.coefficients != first


def test_bad_samples_are_ignored_and_bad_settings_refused():
    m = StepTimeModel(min_samples=4)
    for t in (float("nan"), float("inf"), -1.0):
        m.observe(StepShape(1, 1, 1), t)
    assert len(m.samples) == 0
    with pytest.raises(ValueError):
        StepTimeModel(window=16, min_samples=32)


def test_cut_steps_that_overrun_their_prediction_lower_the_aim():
    m = StepTimeModel()
    assert m.aim(0.090) == pytest.approx(0.090)
    for _ in range(200):
        m.observe_cut(0.080, 0.100)  # cut steps take 1.25x their prediction
    assert m.overrun == pytest.approx(1.25, rel=1e-3)
    assert m.aim(0.090) == pytest.approx(0.072, rel=1e-3)  # predicted 72 ms: they take 90 ms
    m.observe_cut(0.080, 10.0)  # one stalled step moves it by at most OVERRUN_WEIGHT of the clamp
    assert m.overrun == pytest.approx(1.25 + 0.05 * (2.0 - 1.25), rel=1e-3)
    for bad in ((None, 0.1), (0.0, 0.1), (0.08, float("nan")), (0.08, -1.0)):
        m.observe_cut(*bad)
    assert m.overrun == pytest.approx(1.2875, rel=1e-3)
    for _ in range(400):
        m.observe_cut(0.080, 0.010)  # far faster than predicted: the aim rises, at most to twice the target
    assert m.overrun == pytest.approx(0.5, rel=1e-3) and m.aim(0.090) == pytest.approx(0.180, rel=1e-3)

"""The step-time model's predictions against the steps' times, as the engine exports them (kvfleet:step_*)."""

from __future__ import annotations

import pytest

from engine.server.metrics import EngineMetrics
from engine.stats import EngineStats
from engine.step_time import StepTimeStats


def test_stats_record_predicted_against_taken():
    st = StepTimeStats()
    st.record(None, 0.5)  # not fitted yet: only the last step's time
    st.record(0.10, 0.12)
    st.record(0.20, 0.15)
    assert (st.last_s, st.last_predicted_s, st.predicted_steps) == (0.15, 0.20, 2)
    assert (st.predicted_s_total, st.observed_s_total, st.abs_error_s_total) == pytest.approx((0.30, 0.27, 0.07))


def test_the_engine_exports_them():
    stats = EngineStats(kv_usage=0, num_running=0, num_waiting=0, num_total_blocks=1, block_size=16,
                        prefix_queries_tokens=0, prefix_hits_tokens=0, num_preemptions=0, alloc_failures=0,
                        evictions=0, prompt_tokens_total=0, generation_tokens_total=0, step_seconds=0.15,
                        step_predicted_seconds=0.2, steps_predicted=2, step_predicted_seconds_total=0.3,
                        step_observed_seconds_total=0.27, step_prediction_error_seconds_total=0.07)
    text = EngineMetrics("m", lambda: stats).render().decode()
    for line in ('kvfleet:step_seconds{model_name="m"} 0.15', 'kvfleet:step_predicted_seconds_last{model_name="m"} 0.2',
                 'kvfleet:steps_predicted_total{model_name="m"} 2.0',
                 'kvfleet:step_predicted_seconds_total{model_name="m"} 0.3',
                 'kvfleet:step_observed_seconds_total{model_name="m"} 0.27',
                 'kvfleet:step_prediction_error_seconds_total{model_name="m"} 0.07'):
        assert line in text

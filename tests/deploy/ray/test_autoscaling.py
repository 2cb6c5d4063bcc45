"""The engine deployment's autoscaling policy with injected metrics: the HPA algorithm on KV usage and waiting
requests, scale-up past the target at once, scale-down only after the stabilization window."""

from types import SimpleNamespace

import pytest

from deploy.ray.autoscaling import KV_METRIC, WAITING_METRIC, KVAutoscalingPolicy


def policy(**kw) -> KVAutoscalingPolicy:
    return KVAutoscalingPolicy(**{"min_replicas": 1, "max_replicas": 4, "kv_usage_target": 0.7,
                                  "waiting_target": 2, "scale_down_stabilization_s": 300, **kw})


def test_holds_within_tolerance_and_scales_up_past_the_target():
    p = policy()
    assert p.decide(0, 1, {KV_METRIC: [0.72], WAITING_METRIC: [2]}) == (1, "DesiredWithinRange")
    # KV usage 0.95 on one replica: ceil(0.95 / 0.7) = 2
    assert p.decide(15, 1, {KV_METRIC: [0.95], WAITING_METRIC: [0]})[0] == 2
    # waiting requests drive it too: 2 replicas with 5 waiting each against a target of 2 -> ceil(2.5 * 2) = 5,
    # capped at max_replicas
    assert p.decide(30, 2, {KV_METRIC: [0.3, 0.3], WAITING_METRIC: [5, 5]}) == (4, "TooManyReplicas")


def test_scales_down_only_after_the_stabilization_window():
    p = policy(scale_down_stabilization_s=300)
    assert p.decide(0, 1, {KV_METRIC: [0.95], WAITING_METRIC: [3]})[0] == 2
    idle = {KV_METRIC: [0.05, 0.05], WAITING_METRIC: [0, 0]}
    for t in (15, 100, 200, 299):
        assert p.decide(t, 2, idle)[0] == 2, t  # the window still holds the earlier recommendation of 2
    assert p.decide(301, 2, idle)[0] == 1


def test_never_below_min_or_above_max_and_no_metrics_keeps_the_count():
    p = policy(min_replicas=2, max_replicas=3)
    assert p.decide(0, 2, {KV_METRIC: [0.0, 0.0], WAITING_METRIC: [0, 0]})[0] == 2
    assert p.decide(15, 2, {KV_METRIC: [1.0, 1.0], WAITING_METRIC: [50, 50]})[0] == 3
    assert p.decide(30, 3, {}) == (3, "NoMetrics")


def test_serve_context_reads_only_running_replicas_metrics():
    p = policy()
    ctx = SimpleNamespace(
        aggregated_metrics={KV_METRIC: {"a": 0.95, "gone": 0.0}, WAITING_METRIC: {"a": 1.0, "gone": 0.0}},
        running_replicas=["a"], current_time=1000.0, current_num_replicas=1, target_num_replicas=1,
        policy_state={"x": 1})
    desired, state = p(ctx)
    assert desired == 2  # "gone"'s idle metrics would have averaged it down to 1
    assert state == {"x": 1, "kvfleet_reason": "DesiredWithinRange"}
    # the second replica is still loading (1 running, target 2): neither its absence nor a tick without
    # metrics scales back down
    starting = SimpleNamespace(aggregated_metrics={KV_METRIC: {"a": 0.3}, WAITING_METRIC: {"a": 0.0}},
                               running_replicas=["a"], current_time=1001.0, current_num_replicas=1,
                               target_num_replicas=2, policy_state={})
    assert p(starting)[0] == 2
    assert p(SimpleNamespace(**{**vars(starting), "aggregated_metrics": {}, "current_time": 1002.0}))[0] == 2


def test_bad_target_names_the_field():
    with pytest.raises(ValueError, match="kv_usage_target"):
        policy(kv_usage_target=1.5)

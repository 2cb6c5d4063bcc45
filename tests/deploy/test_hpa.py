"""deploy/hpa.py against the autoscaling/v2 controller's arithmetic, case by case."""

from __future__ import annotations

import pytest

from deploy.hpa import (
    DEFAULT_SCALE_DOWN,
    DEFAULT_SCALE_UP,
    HPA,
    HPASpec,
    MetricTarget,
    PolicyKind,
    ScalingPolicy,
    ScalingRules,
    SelectPolicy,
    metric_proposal,
    replay,
)

KV, WAITING = MetricTarget("kv", 0.7), MetricTarget("waiting", 2.0)
NO_LIMITS = ScalingRules(0, (ScalingPolicy(PolicyKind.PERCENT, 1000, 15),))


def spec(**kw) -> HPASpec:
    return HPASpec(**{"min_replicas": 1, "max_replicas": 10, "metrics": (KV, WAITING), **kw})


def test_metric_proposal_ratio_ceil_and_tolerance():
    assert metric_proposal(2, [0.9, 0.95], 0.7, 0.1) == 3      # mean 0.925 / 0.7 = 1.32 -> ceil(2.64)
    assert metric_proposal(2, [0.75, 0.75], 0.7, 0.1) == 2     # ratio 1.071: within the tolerance
    assert metric_proposal(2, [0.78, 0.78], 0.7, 0.1) == 3     # ratio 1.114: outside -> ceil(2.23)
    assert metric_proposal(3, [0.65, 0.65, 0.65], 0.7, 0.1) == 3  # 0.929: within
    assert metric_proposal(4, [0.2] * 4, 0.7, 0.1) == 2        # ceil(4 x 0.2857) = ceil(1.14)
    assert metric_proposal(2, [0, 0], 0.7, 0.1) == 0
    assert metric_proposal(3, [0.3, 0.3, 0.3], 0.1, 0.0) == 9  # on milli-units: 300 / 100 exactly
    assert metric_proposal(3, [0.0004] * 3, 0.002, 0.1) == 2   # 0.4 milli rounds up to 1: ratio 0.5 (not 0.2 -> 1)
    assert metric_proposal(3, [0.001, 0.001, 0.002], 0.001, 0.1) == 3  # mean 4 // 3 = 1 milli: ratio 1 (not 1.33)


def test_the_largest_metric_proposal_wins():
    hpa = HPA(spec(scale_up=NO_LIMITS, scale_down=ScalingRules(0, NO_LIMITS.policies)))
    d = hpa.step(0, 2, {"kv": [0.5, 0.5], "waiting": [4, 6]})  # kv asks 2 (0.714 -> ceil 1.43), waiting 5
    assert (d.desired, dict(d.proposals)) == (5, {"kv": 2, "waiting": 5})
    d = hpa.step(1, 5, {"kv": [0.95] * 5, "waiting": [0] * 5})  # kv asks ceil(5 x 1.357) = 7
    assert (d.desired, dict(d.proposals)) == (7, {"kv": 7, "waiting": 0})


def test_a_missing_metric_is_left_out_and_none_keeps_the_count():
    hpa = HPA(spec(scale_up=NO_LIMITS))
    assert hpa.step(0, 2, {"waiting": [4, 4]}).desired == 4
    assert hpa.step(1, 4, {}).desired == 4 and hpa.step(2, 4, {}).reason == "NoMetrics"


def test_default_scale_up_rate_limit_max_of_100_percent_and_4_pods_per_15s():
    hpa = HPA(spec(max_replicas=20))
    d = hpa.step(0, 1, {"kv": [7.0], "waiting": [0]})           # asks 10; limit max(2, 5) = 5
    assert (d.desired, d.reason) == (5, "ScaleUpLimit")
    d = hpa.step(10, 5, {"kv": [1.4] * 5, "waiting": [0] * 5})   # asks 10; period began at 1 -> limit 5
    assert (d.desired, d.reason) == (5, "ScaleUpLimit")
    d = hpa.step(16, 5, {"kv": [1.4] * 5, "waiting": [0] * 5})   # a new period: max(10, 9) -> 10
    assert (d.desired, d.reason) == (10, "DesiredWithinRange")


def test_scale_down_waits_for_the_stabilization_window():
    hpa = HPA(spec(scale_down=ScalingRules(60, DEFAULT_SCALE_DOWN.policies)))
    assert hpa.step(0, 2, {"kv": [1.4, 1.4], "waiting": [0, 0]}).desired == 4
    busy, idle = {"kv": [0.7] * 4, "waiting": [2] * 4}, {"kv": [0.0] * 4, "waiting": [0] * 4}
    assert hpa.step(15, 4, busy).desired == 4
    assert [hpa.step(t, 4, idle).desired for t in (30, 45, 60, 74)] == [4, 4, 4, 4]  # 15 s rec still in window
    d = hpa.step(76, 4, idle)                                     # every recommendation of the last 60 s: 0
    assert (d.desired, d.reason) == (1, "TooFewReplicas")


def test_scale_down_policy_pods_per_period():
    rules = ScalingRules(0, (ScalingPolicy(PolicyKind.PODS, 1, 60),))
    hpa = HPA(spec(scale_down=rules))
    idle = {"kv": [0.0] * 4, "waiting": [0] * 4}
    d = hpa.step(0, 4, idle)
    assert (d.desired, d.reason) == (3, "ScaleDownLimit")
    assert hpa.step(30, 3, {"kv": [0.0] * 3, "waiting": [0] * 3}).desired == 3   # period began at 4: 4 - 1
    assert hpa.step(61, 3, {"kv": [0.0] * 3, "waiting": [0] * 3}).desired == 2


def test_select_min_and_disabled():
    up_min = ScalingRules(0, DEFAULT_SCALE_UP.policies, SelectPolicy.MIN)
    assert HPA(spec(scale_up=up_min)).step(0, 4, {"kv": [7.0] * 4, "waiting": [0] * 4}).desired == 8  # min(8, 8)
    assert HPA(spec(scale_up=up_min)).step(0, 2, {"kv": [7.0] * 2, "waiting": [0] * 2}).desired == 4  # min(4, 6)
    off = ScalingRules(0, (), SelectPolicy.DISABLED)
    assert HPA(spec(scale_up=off)).step(0, 2, {"kv": [7.0] * 2, "waiting": [0] * 2}).desired == 2
    assert HPA(spec(scale_down=off)).step(0, 5, {"kv": [0.0] * 5, "waiting": [0] * 5}).desired == 5


def test_min_and_max_replicas():
    hpa = HPA(spec(max_replicas=6, scale_up=NO_LIMITS))
    d = hpa.step(0, 4, {"kv": [7.0] * 4, "waiting": [0] * 4})
    assert (d.desired, d.reason) == (6, "TooManyReplicas")
    assert HPA(spec(max_replicas=6)).step(0, 9, {}).desired == 6     # above max: brought down at once
    assert HPA(spec(min_replicas=3)).step(0, 1, {}).desired == 3     # below min: brought up at once
    assert HPA(spec()).step(0, 0, {"kv": [1.0]}).reason == "ScalingDisabled"


def test_replay_follows_its_own_decisions_and_shares_the_total():
    s = spec(scale_up=NO_LIMITS, scale_down=ScalingRules(0, NO_LIMITS.policies))
    out = replay(s, [0, 1, 2], {"kv": [2.8, 2.8, 0.0], "waiting": [0, 0, 0]}, start_replicas=2)
    assert [d.desired for d in out] == [4, 4, 1]  # 2.8 over 2 pods: 1.4 each -> 4; over 4: 0.7 each -> stay


@pytest.mark.parametrize("make,field", [
    (lambda: MetricTarget("kv", 0), "MetricTarget.average_value"),
    (lambda: ScalingPolicy(PolicyKind.PODS, 0, 15), "ScalingPolicy.value"),
    (lambda: ScalingPolicy(PolicyKind.PODS, 1, 0), "ScalingPolicy.period_s"),
    (lambda: ScalingRules(-1, DEFAULT_SCALE_UP.policies), "ScalingRules.stabilization_window_s"),
    (lambda: ScalingRules(0, ()), "ScalingRules.policies"),
    (lambda: spec(min_replicas=0), "HPASpec.min_replicas"),
    (lambda: spec(max_replicas=0), "HPASpec.max_replicas"),
    (lambda: spec(metrics=()), "HPASpec.metrics"),
    (lambda: spec(metrics=(KV, KV)), "HPASpec.metrics"),
    (lambda: spec(tolerance=1.0), "HPASpec.tolerance"),
])
def test_bad_specs_name_the_field(make, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        make()

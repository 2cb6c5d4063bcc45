"""The Kubernetes autoscaling/v2 HorizontalPodAutoscaler algorithm, pure: what replica count an HPA would set.

Follows the controller (pkg/controller/podautoscaler: replica_calculator.go, horizontal.go) for `Pods`
metrics with an `AverageValue` target, every pod ready and reporting:

- per metric: usage ratio = (sum of the pods' values / pods) / target, on milli-units as the controller
  does (values rounded up to 1/1000, the average divided as integers); within `tolerance` (0.1) of 1 the
  proposal is the current count, else ceil(ratio x pods);
- the largest proposal over all metrics wins (KV usage and waiting requests are co-equal signals);
- stabilization: the recommendation is held between the lowest proposal of the scale-up window and the
  highest of the scale-down window (so a replica is removed only when every proposal of the last
  `scale_down.stabilization_window_s` seconds agrees);
- rate limits (scaling policies: at most N pods or P percent per period, `select` Max/Min/Disabled), then
  min/max replicas. A current count above max or below min is brought inside first, as the controller does.

Time is passed in (`now`, seconds), never read, so a recorded series can be replayed exactly.

    hpa = HPA(HPASpec(min_replicas=1, max_replicas=8, metrics=(MetricTarget("kv", 0.7),
                                                                MetricTarget("waiting", 2.0))))
    d = hpa.step(now=30.0, current=2, metrics={"kv": [0.9, 0.95], "waiting": [4, 6]})
    d.desired, d.reason     # 5 (waiting: ceil(5/2 x 2)), 'ScaleUpLimit' / 'DesiredWithinRange' / ...
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum


class PolicyKind(str, Enum):
    PODS = "Pods"
    PERCENT = "Percent"


class SelectPolicy(str, Enum):
    MAX = "Max"
    MIN = "Min"
    DISABLED = "Disabled"


@dataclass(frozen=True)
class ScalingPolicy:
    kind: PolicyKind
    value: int
    period_s: float

    def __post_init__(self):
        if self.value <= 0:
            raise ValueError(f"ScalingPolicy.value: must be > 0, got {self.value}")
        if not 0 < self.period_s <= 1800:
            raise ValueError(f"ScalingPolicy.period_s: must be in (0, 1800], got {self.period_s}")


@dataclass(frozen=True)
class ScalingRules:
    stabilization_window_s: float
    policies: tuple[ScalingPolicy, ...]
    select: SelectPolicy = SelectPolicy.MAX

    def __post_init__(self):
        if not 0 <= self.stabilization_window_s <= 3600:
            raise ValueError(f"ScalingRules.stabilization_window_s: must be in [0, 3600], got "
                             f"{self.stabilization_window_s}")
        if not self.policies and self.select is not SelectPolicy.DISABLED:
            raise ValueError("ScalingRules.policies: at least one policy unless select is Disabled")


# the API server's defaults for autoscaling/v2 `behavior`
DEFAULT_SCALE_UP = ScalingRules(0, (ScalingPolicy(PolicyKind.PERCENT, 100, 15), ScalingPolicy(PolicyKind.PODS, 4, 15)))
DEFAULT_SCALE_DOWN = ScalingRules(300, (ScalingPolicy(PolicyKind.PERCENT, 100, 15),))


@dataclass(frozen=True)
class MetricTarget:
    name: str
    average_value: float  # target per pod

    def __post_init__(self):
        if not self.average_value > 0:
            raise ValueError(f"MetricTarget.average_value ({self.name}): must be > 0, got {self.average_value}")


@dataclass(frozen=True)
class HPASpec:
    min_replicas: int
    max_replicas: int
    metrics: tuple[MetricTarget, ...]
    scale_up: ScalingRules = DEFAULT_SCALE_UP
    scale_down: ScalingRules = DEFAULT_SCALE_DOWN
    tolerance: float = 0.1

    def __post_init__(self):
        if self.min_replicas < 1:
            raise ValueError(f"HPASpec.min_replicas: must be >= 1, got {self.min_replicas}")
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"HPASpec.max_replicas: must be >= min_replicas ({self.min_replicas}), got "
                             f"{self.max_replicas}")
        if not self.metrics:
            raise ValueError("HPASpec.metrics: at least one metric")
        names = [m.name for m in self.metrics]
        if len(set(names)) != len(names):
            raise ValueError(f"HPASpec.metrics: names must be unique, got {names}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"HPASpec.tolerance: must be in [0, 1), got {self.tolerance}")


@dataclass(frozen=True)
class Decision:
    desired: int
    reason: str              # ScaleUpLimit, ScaleDownLimit, TooFewReplicas, TooManyReplicas, DesiredWithinRange, ...
    proposals: Mapping[str, int] = field(default_factory=dict)  # per metric, before stabilization and limits


def _milli(value: float) -> int:
    return math.ceil(round(value * 1000, 6))


def metric_proposal(current: int, per_pod: Sequence[float], target: float, tolerance: float) -> int:
    """Replicas one AverageValue metric asks for (the controller's calcPlainMetricReplicas, all pods ready)."""
    average = sum(_milli(v) for v in per_pod) // len(per_pod)
    ratio = average / _milli(target)
    if abs(1.0 - ratio) <= tolerance:
        return current
    return math.ceil(ratio * len(per_pod))


@dataclass
class _Event:
    at: float
    change: int


class HPA:
    """One HPA's controller state (recommendations, scale events); `step` is one reconcile."""

    def __init__(self, spec: HPASpec):
        self.spec = spec
        self._recommendations: list[tuple[float, int]] = []
        self._up_events: list[_Event] = []
        self._down_events: list[_Event] = []

    def step(self, now: float, current: int, metrics: Mapping[str, Sequence[float]]) -> Decision:
        s = self.spec
        if current == 0:
            return Decision(0, "ScalingDisabled")  # scaled to zero by hand: the HPA leaves it alone
        if current > s.max_replicas:
            return self._scaled(now, current, s.max_replicas, "TooManyReplicas")
        if current < s.min_replicas:
            return self._scaled(now, current, s.min_replicas, "TooFewReplicas")
        proposals = {m.name: metric_proposal(current, metrics[m.name], m.average_value, s.tolerance)
                     for m in s.metrics if metrics.get(m.name)}
        if not proposals:
            return Decision(current, "NoMetrics")
        desired = max(proposals.values())
        desired = self._stabilize(now, current, desired)
        desired, reason = self._limit(now, current, desired)
        d = self._scaled(now, current, desired, reason)
        return Decision(d.desired, d.reason, proposals)

    def _scaled(self, now: float, current: int, desired: int, reason: str) -> Decision:
        if desired > current:
            self._up_events.append(_Event(now, desired - current))
        elif desired < current:
            self._down_events.append(_Event(now, current - desired))
        return Decision(desired, reason)

    def _stabilize(self, now: float, current: int, desired: int) -> int:
        up_cut = now - self.spec.scale_up.stabilization_window_s
        down_cut = now - self.spec.scale_down.stabilization_window_s
        up, down = desired, desired
        old = None
        for i, (at, rec) in enumerate(self._recommendations):
            if at > up_cut:
                up = min(up, rec)
            if at > down_cut:
                down = max(down, rec)
            if at < up_cut and at < down_cut:
                old = i
        if old is None:
            self._recommendations.append((now, desired))
        else:
            self._recommendations[old] = (now, desired)
        return min(max(current, up), down)

    def _limit(self, now: float, current: int, desired: int) -> tuple[int, str]:
        s = self.spec
        up_limit = max(self._up_limit(now, current), current)
        down_limit = min(self._down_limit(now, current), current)
        highest, lowest = min(s.max_replicas, up_limit), max(s.min_replicas, down_limit)
        if desired > highest:
            return highest, "ScaleUpLimit" if up_limit < s.max_replicas else "TooManyReplicas"
        if desired < lowest:
            return lowest, "ScaleDownLimit" if down_limit > s.min_replicas else "TooFewReplicas"
        return desired, "DesiredWithinRange"

    def _period_start(self, now: float, current: int, period_s: float) -> int:
        added = sum(e.change for e in self._up_events if e.at > now - period_s)
        removed = sum(e.change for e in self._down_events if e.at > now - period_s)
        return current - added + removed

    def _up_limit(self, now: float, current: int) -> int:
        return self._policy_limit(now, current, up=True)

    def _down_limit(self, now: float, current: int) -> int:
        return self._policy_limit(now, current, up=False)

    def _policy_limit(self, now: float, current: int, up: bool) -> int:
        """The replica count the scaling policies allow in one direction (Kubernetes' calculateScaleUpLimit
        / calculateScaleDownLimit): each policy's change from the count at the start of its period; `Max`
        selects the policy allowing the largest change, `Min` the smallest."""
        rules = self.spec.scale_up if up else self.spec.scale_down
        if rules.select is SelectPolicy.DISABLED:
            return current
        largest_change = rules.select is not SelectPolicy.MIN
        pick = max if largest_change == up else min
        result = None
        for p in rules.policies:
            start = self._period_start(now, current, p.period_s)
            if up:
                proposed = start + p.value if p.kind is PolicyKind.PODS else math.ceil(start * (1 + p.value / 100))
            else:
                proposed = start - p.value if p.kind is PolicyKind.PODS else int(start * (1 - p.value / 100))
            result = proposed if result is None else pick(result, proposed)
        return result


def replay(spec: HPASpec, times: Sequence[float], series: Mapping[str, Sequence[float]], start_replicas: int,
           per_pod=None) -> list[Decision]:
    """Run the HPA over recorded fleet totals, one reconcile per sample, the replica count following its
    decisions. series[name][i] is the metric summed over the fleet at times[i]; each of the `current` pods
    is given an equal share (per_pod(total, current) to model otherwise), as load spreads over new replicas."""
    share = per_pod or (lambda total, n: [total / n] * n)
    hpa, current, out = HPA(spec), start_replicas, []
    for i, t in enumerate(times):
        d = hpa.step(t, current, {name: share(values[i], current) for name, values in series.items()})
        out.append(d)
        current = d.desired
    return out

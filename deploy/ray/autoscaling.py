"""Autoscaling of the engine deployment on KV-cache usage and waiting requests: a Serve custom autoscaling policy
that runs the Kubernetes HPA algorithm of deploy/hpa.py (the chart's model: largest proposal over both metrics,
tolerance, scale-up and scale-down stabilization windows, rate limits), on the metrics each engine replica reports
through `record_autoscaling_stats` (engine_replica.py: `kv_usage`, `waiting`), averaged by Serve over
`look_back_period_s`.

Configured in the deployment's autoscaling_config:

    policy: {policy_function: deploy.ray.autoscaling:KVAutoscalingPolicy,
             policy_kwargs: {min_replicas: 1, max_replicas: 4, kv_usage_target: 0.7, waiting_target: 2,
                             scale_down_stabilization_s: 600}}
    upscale_delay_s: 0      # the stabilization windows above are the delays: Serve's own stay off
    downscale_delay_s: 0

Serve instantiates the class once per deployment and calls it every control-loop tick with an
AutoscalingContext; `decide` is the pure part (metrics and time in, replica count out), tested with injected
metrics.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from deploy.hpa import DEFAULT_SCALE_UP, HPA, HPASpec, MetricTarget, PolicyKind, ScalingPolicy, ScalingRules

KV_METRIC = "kv_usage"
WAITING_METRIC = "waiting"


class KVAutoscalingPolicy:
    def __init__(self, min_replicas: int = 1, max_replicas: int = 4, kv_usage_target: float = 0.7,
                 waiting_target: float = 2.0, scale_down_stabilization_s: float = 600.0,
                 scale_up_stabilization_s: float = 0.0, tolerance: float = 0.1):
        if not 0 < kv_usage_target <= 1:
            raise ValueError(f"policy_kwargs.kv_usage_target: must be in (0, 1], got {kv_usage_target}")
        up = ScalingRules(scale_up_stabilization_s, DEFAULT_SCALE_UP.policies)
        down = ScalingRules(scale_down_stabilization_s, (ScalingPolicy(PolicyKind.PERCENT, 100, 15),))
        self.hpa = HPA(HPASpec(min_replicas, max_replicas,
                               (MetricTarget(KV_METRIC, kv_usage_target), MetricTarget(WAITING_METRIC, waiting_target)),
                               scale_up=up, scale_down=down, tolerance=tolerance))

    def decide(self, now: float, current: int, metrics: Mapping[str, Sequence[float]]) -> tuple[int, str]:
        """The replica count for `current` replicas whose per-replica metrics are `metrics` at time `now`."""
        d = self.hpa.step(now, current, metrics)
        return d.desired, d.reason

    def __call__(self, ctx) -> tuple[int, dict]:
        aggregated = ctx.aggregated_metrics or {}
        running = set(ctx.running_replicas)
        metrics = {name: [float(v) for rid, v in (aggregated.get(name) or {}).items() if rid in running]
                   for name in (KV_METRIC, WAITING_METRIC)}
        now = ctx.current_time if ctx.current_time is not None else time.time()
        # the HPA's "current" is the scale target (spec.replicas), not the replicas already running: a replica
        # still loading its model must not read as a scale-down, nor a tick without metrics as "hold at 1"
        desired, reason = self.decide(now, ctx.target_num_replicas, metrics)
        state = dict(ctx.policy_state or {})
        state["kvfleet_reason"] = reason
        return desired, state

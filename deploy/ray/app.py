"""The Serve application: `build_app(args)` is the import path of the serve config (`deploy.ray.app:build_app`),
run by `serve run deploy/ray/serve_config.yaml`, `serve deploy` (KubeRay's RayService) and `kvfleet ray up`.

    ingress (OpenAI API, tokenizes and hashes once)  --DeploymentHandle + RouteHint-->  EngineReplica x N
                                                       KVRequestRouter picks the replica (kvfleet policies)

`args` (the application's `args:` in the serve config) is validated once into RayAppConfig; errors name the
field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from contract.errors import ConfigError

ENGINE_DEPLOYMENT = "EngineReplica"
INGRESS_DEPLOYMENT = "Ingress"
APP_NAME = "kvfleet"


@dataclass(frozen=True)
class RayAppConfig:
    engine: Mapping = field(default_factory=dict)  # EngineArgs fields (model, block_size, hash_seed, num_threads...)
    policy: str = "kv"  # a router/routing/policies name
    scoring: Mapping = field(default_factory=dict)  # ScoringConfig fields
    replicas: int | None = None  # a fixed engine replica count; None: autoscaling
    autoscaling: Mapping = field(default_factory=lambda: {"min_replicas": 1, "max_replicas": 4})
    num_cpus: float = 1.0  # per engine replica
    num_gpus: float = 0.0  # per engine replica
    max_ongoing_requests: int = 64  # per engine replica (a stream of KV events counts as one per ingress)
    routing_stats_period_s: float = 1.0
    look_back_period_s: float = 10.0
    ingress_replicas: int = 1
    ingress_num_cpus: float = 0.5
    # benchmarks: replicas serve the ASGI app this "module:function" builds instead of an engine, called as
    # function(instance_id, **app_options) (loadtest/ray_overhead.py: "loadtest.fake_engine:make_app")
    app_factory: str | None = None
    app_options: Mapping = field(default_factory=dict)

    def __post_init__(self):
        from router.routing.policies import POLICIES

        if self.policy not in POLICIES:
            raise ConfigError("policy", f"policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        if self.replicas is not None and (not isinstance(self.replicas, int) or self.replicas < 1):
            raise ConfigError("replicas", f"replicas must be an integer >= 1 (or null: autoscaling), got {self.replicas!r}")
        for name in ("num_cpus", "num_gpus", "ingress_num_cpus"):
            if not isinstance(getattr(self, name), (int, float)) or getattr(self, name) < 0:
                raise ConfigError(name, f"{name} must be a number >= 0, got {getattr(self, name)!r}")
        for name in ("max_ongoing_requests", "ingress_replicas"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(name, f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("routing_stats_period_s", "look_back_period_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.app_factory is not None:
            from deploy.ray.engine_replica import load_app_factory

            load_app_factory(self.app_factory)
        if not isinstance(self.app_options, Mapping):
            raise ConfigError("app_options", f"app_options must be a mapping, got {self.app_options!r}")

    @classmethod
    def from_args(cls, args: Mapping | None) -> RayAppConfig:
        args = dict(args or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ConfigError(unknown[0], f"unknown application arg(s) {unknown}; known: {sorted(known)}")
        return cls(**args)

    def engine_args(self):
        """The engine's own validation (EngineArgs: errors name the flag) before anything starts."""
        from engine.args import EngineArgs

        try:
            return EngineArgs(**dict(self.engine))
        except TypeError as e:
            raise ConfigError("engine", f"engine: {e}") from None

    def autoscaling_policy(self):
        """The KVAutoscalingPolicy these args configure (validated here, instantiated again by Serve)."""
        from deploy.ray.autoscaling import KVAutoscalingPolicy

        try:
            return KVAutoscalingPolicy(**dict(self.autoscaling))
        except (TypeError, ValueError) as e:
            raise ConfigError("autoscaling", f"autoscaling: {e}") from None

    def engine_options(self) -> dict:
        """The engine deployment's options (serve.deployment(...).options)."""
        from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

        args = self.engine_args()
        opts: dict = {
            "name": ENGINE_DEPLOYMENT,
            "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
            "max_ongoing_requests": self.max_ongoing_requests,
            "request_router_config": RequestRouterConfig(
                request_router_class="deploy.ray.request_router:KVRequestRouter",
                request_router_kwargs={"policy": self.policy, "scoring": dict(self.scoring),
                                       "block_size": args.block_size, "hash_seed": args.hash_seed},
                request_routing_stats_period_s=self.routing_stats_period_s),
            "health_check_period_s": 5.0,
            "graceful_shutdown_timeout_s": 30.0,
        }
        if args.device == "cuda" and not self.num_gpus:
            raise ConfigError("num_gpus", "engine.device is cuda: num_gpus must be > 0")
        if self.replicas is not None:
            opts["num_replicas"] = self.replicas
        else:
            self.autoscaling_policy()
            a = dict(self.autoscaling)
            opts["autoscaling_config"] = AutoscalingConfig(
                min_replicas=a.get("min_replicas", 1), max_replicas=a.get("max_replicas", 4),
                initial_replicas=a.get("min_replicas", 1), upscale_delay_s=0, downscale_delay_s=0,
                metrics_interval_s=1.0, look_back_period_s=self.look_back_period_s,
                policy=AutoscalingPolicy(policy_function="deploy.ray.autoscaling:KVAutoscalingPolicy",
                                         policy_kwargs=a))
        return opts


def build_app(args: Mapping | None = None):
    from ray import serve

    from deploy.ray.engine_replica import EngineReplica
    from deploy.ray.ingress import Ingress

    cfg = RayAppConfig.from_args(args)
    engine = serve.deployment(EngineReplica).options(**cfg.engine_options())
    ingress = serve.deployment(Ingress).options(
        name=INGRESS_DEPLOYMENT, num_replicas=cfg.ingress_replicas, max_ongoing_requests=1000,
        ray_actor_options={"num_cpus": cfg.ingress_num_cpus})
    from router.routing.policies import POLICIES

    need_tokens = POLICIES[cfg.policy].needs.prompt_tokens
    engine_kwargs = ({"app_factory": cfg.app_factory, "app_options": dict(cfg.app_options)}
                     if cfg.app_factory is not None else {})
    return ingress.bind(engine.bind(dict(cfg.engine), **engine_kwargs), dict(cfg.engine), need_tokens)

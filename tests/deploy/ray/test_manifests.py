"""The serve config, the RayService manifest (against KubeRay's vendored CRD and Serve's own config schema),
the application args' validation, and what `kvfleet ray up` runs."""

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from contract.errors import ConfigError
from deploy.ray.app import RayAppConfig, build_app
from deploy.ray.cli import SERVE_CONFIG, plan
from kvfleet.cli import COMMANDS
from tests.helm import crd_schema

RAY = Path(__file__).resolve().parents[3] / "deploy" / "ray"


def rayservice() -> dict:
    return yaml.safe_load((RAY / "rayservice.yaml").read_text())


def test_rayservice_validates_against_the_kuberay_crd():
    svc = rayservice()
    assert ("ray.io/v1", "RayService") in crd_schema.kinds()
    assert crd_schema.errors(svc) == []
    broken = rayservice()
    broken["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}  # a typo: rejected
    assert crd_schema.errors(broken)


@pytest.mark.parametrize("source", ["serve_config.yaml", "rayservice.yaml"])
def test_serve_configs_pass_serves_schema_and_our_args_validation(source):
    text = (RAY / source).read_text()
    config = yaml.safe_load(yaml.safe_load(text)["spec"]["serveConfigV2"] if source == "rayservice.yaml" else text)
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    assert app.import_path == "deploy.ray.app:build_app" and app.route_prefix == "/"
    cfg = RayAppConfig.from_args(app.args)
    cfg.engine_args()
    cfg.autoscaling_policy()
    opts = cfg.engine_options()
    assert opts["request_router_config"].request_router_class == "deploy.ray.request_router:KVRequestRouter"
    auto = opts["autoscaling_config"]  # both run autoscaling; the HPA windows replace Serve's delays
    assert auto.policy.policy_function == "deploy.ray.autoscaling:KVAutoscalingPolicy"
    assert (auto.upscale_delay_s, auto.downscale_delay_s) == (0, 0)
    assert auto.policy.policy_kwargs["scale_down_stabilization_s"] == 600


def test_the_rayservice_runs_the_serve_config_with_gpu_engines():
    local = yaml.safe_load(SERVE_CONFIG.read_text())["applications"][0]["args"]
    k8s = yaml.safe_load(rayservice()["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert k8s["num_gpus"] == 1 and k8s["engine"]["device"] == "cuda"
    same = {k: v for k, v in local.items() if k not in ("num_gpus", "num_cpus", "engine")}
    assert same == {k: v for k, v in k8s.items() if k in same}
    assert RayAppConfig.from_args(k8s).engine_options()["ray_actor_options"]["num_gpus"] == 1


@pytest.mark.parametrize("args, field", [({"policy": "nope"}, "policy"), ({"replicas": 0}, "replicas"),
                                         ({"replica": 2}, "replica"), ({"engine": {"block_size": 7}}, "--block-size"),
                                         ({"autoscaling": {"kv_usage_target": 2}}, "autoscaling"),
                                         ({"engine": {"device": "cuda"}}, "num_gpus")])
def test_bad_args_name_the_field(args, field):
    with pytest.raises(ConfigError) as e:
        RayAppConfig.from_args(args).engine_options()
    assert e.value.field == field or field in str(e.value)


@pytest.mark.parametrize("spec, says", [("loadtest.fake_engine", "must be a 'module:function' string"),
                                        (42, "must be a 'module:function' string"),
                                        ("no_such_module_here:make_app", "cannot import no_such_module_here"),
                                        ("loadtest.fake_engine:no_such_function", "has no function no_such_function")])
def test_a_bad_app_factory_is_a_clear_error(spec, says):
    with pytest.raises(ConfigError) as e:
        RayAppConfig.from_args({"app_factory": spec})
    assert e.value.field == "app_factory" and says in str(e.value)


def test_an_app_factory_builds_the_replicas_app():
    from deploy.ray.engine_replica import load_app_factory

    cfg = RayAppConfig.from_args({"app_factory": "loadtest.fake_engine:make_app", "app_options": {"chunks": 2}})
    app = load_app_factory(cfg.app_factory)("r1", **cfg.app_options)
    assert callable(app) and app.ns.instance_id == "r1" and app.ns.chunks == 2


def test_ray_up_runs_the_serve_config_with_the_flags_applied():
    config = yaml.safe_load(SERVE_CONFIG.read_text())["applications"][0]
    up = plan(SERVE_CONFIG, replicas=2, port=8123, policy="round-robin", cpu_count=2)
    assert (up.name, up.route_prefix, up.import_path) == (config["name"], "/", config["import_path"])
    assert up.builder() is build_app
    assert up.args["replicas"] == 2 and up.args["policy"] == "round-robin" and up.port == 8123
    assert up.args["engine"] == {**config["args"]["engine"], "num_threads": 1}  # 2 cores over 2 replicas
    assert {k: v for k, v in up.args.items() if k not in ("replicas", "policy", "engine")} == \
        {k: v for k, v in config["args"].items() if k not in ("replicas", "policy", "engine")}
    assert RayAppConfig.from_args(up.args).engine_options()["num_replicas"] == 2
    assert up.num_cpus >= 2 * 1 + 0.5
    auto = plan(SERVE_CONFIG, replicas=None, port=8000, policy=None, cpu_count=2)
    assert auto.args["replicas"] is None and "autoscaling_config" in RayAppConfig.from_args(auto.args).engine_options()
    assert COMMANDS["ray"][0] == "deploy.ray.cli"

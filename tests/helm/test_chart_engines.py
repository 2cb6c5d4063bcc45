"""The engine pools the chart renders: one Deployment, headless Service and PDB per enabled pool, each with its
own model, flags, replicas and version label; probes, drain, GPU, token, model sources; autoscaling."""

from __future__ import annotations

import re

import helm_python as helm
import pytest
import yaml

from tests.helm.chart import ALL_POOLS, CHART, RELEASE, TOGGLES, container, engine, render


def test_one_deployment_service_and_pdb_per_enabled_pool():
    r = render(ALL_POOLS)
    for kind in ("Deployment", "Service", "PodDisruptionBudget"):
        names = sorted(m["metadata"]["name"] for m in r.of(kind) if "engine" in m["metadata"]["name"])
        assert names == [f"{RELEASE}-kvfleet-engine-{p}" for p in ("canary", "long", "stable")], kind
    assert len([m for m in render().of("Deployment") if "engine" in m["metadata"]["name"]]) == 1


def test_each_pool_has_its_own_model_flags_replicas_and_version():
    r = render({"pools": {"canary": {"enabled": True, "model": "/models/v2", "replicas": 3,
                                     "modelSource": {"type": "hostPath", "hostPath": {"path": "/mnt/m"}},
                                     "extraArgs": ["--max-num-seqs", "64"]}}})
    stable, canary = engine(r, "stable"), engine(r, "canary")
    args = container(canary, "engine")["args"]
    assert "--model=/models/v2" in args and args[-2:] == ["--max-num-seqs", "64"]
    assert "--model=smollm2" in container(stable, "engine")["args"]
    assert (stable["spec"]["replicas"], canary["spec"]["replicas"]) == (1, 3)
    assert stable["spec"]["strategy"] == {"type": "RollingUpdate",
                                          "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    assert canary["spec"]["template"]["metadata"]["labels"]["kvfleet.dev/version"] == "v2"
    assert stable["spec"]["template"]["metadata"]["labels"]["kvfleet.dev/version"] == "v1"
    # the version label stays out of the (immutable) selector, so a new version is a rolling update
    assert "kvfleet.dev/version" not in canary["spec"]["selector"]["matchLabels"]


def test_engine_container_runs_behind_the_internal_token_with_probes_and_drain():
    dep = engine(render({"engineDefaults": {"drainTimeoutSeconds": 120, "preStopSleepSeconds": 7}}), "stable")
    spec = dep["spec"]["template"]["spec"]
    c = container(dep, "engine")
    assert "--require-internal-token" in c["args"] and "--drain-timeout=120" in c["args"]
    token = next(e for e in c["env"] if e["name"] == "KVFLEET_INTERNAL_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": f"{RELEASE}-kvfleet-internal-token", "key": "token"}
    assert c["startupProbe"]["httpGet"]["path"] == "/ready"
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 1200  # slow loads
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "7"]
    assert spec["terminationGracePeriodSeconds"] == 120 + 7 + 15
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 == c["resources"]["requests"]["nvidia.com/gpu"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["KVFLEET_CACHE_DIR"].startswith("/cache") and env["TRITON_CACHE_DIR"].startswith("/cache")
    assert env["HF_HOME"].startswith("/cache") and env["HF_HUB_OFFLINE"] == "1"
    assert {"name": "cache", "mountPath": "/cache"} in c["volumeMounts"]
    assert c["securityContext"]["readOnlyRootFilesystem"] and spec["securityContext"]["runAsNonRoot"]
    assert spec["automountServiceAccountToken"] is False


def test_grace_period_below_drain_plus_prestop_is_refused():
    with pytest.raises(helm.HelmError, match="terminationGracePeriodSeconds .* must exceed"):
        render({"engineDefaults": {"drainTimeoutSeconds": 60, "terminationGracePeriodSeconds": 60}})
    dep = engine(render({"engineDefaults": {"terminationGracePeriodSeconds": 300}}), "stable")
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 300


def test_pool_overrides_merge_over_defaults_including_false_and_zero():
    """A pool's false, 0 and partial maps override engineDefaults key by key."""
    r = render({"pools": {"canary": {"enabled": True, "weight": 0, "pdb": {"enabled": False}, "gpus": 0,
                                     "resources": {"requests": {"cpu": "2"}}}}})
    names = [m["metadata"]["name"] for m in r.of("PodDisruptionBudget")]
    assert f"{RELEASE}-kvfleet-engine-canary" not in names and f"{RELEASE}-kvfleet-engine-stable" in names
    res = container(engine(r, "canary"), "engine")["resources"]
    assert "nvidia.com/gpu" not in res["requests"] and res["requests"]["cpu"] == "2"
    assert res["requests"]["memory"] == "32Gi"  # the rest of the default map stays


def _volume(dep, name):
    return next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == name)


def test_model_from_an_existing_pvc_is_mounted_read_only():
    dep = engine(render(TOGGLES["model-pvc"]), "stable")
    assert _volume(dep, "model")["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    mount = next(m for m in container(dep, "engine")["volumeMounts"] if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": "/models", "readOnly": True, "subPath": "hf"}


def test_model_from_a_host_path():
    dep = engine(render(TOGGLES["model-hostpath"]), "stable")
    assert _volume(dep, "model")["hostPath"] == {"path": "/mnt/models", "type": "Directory"}


def test_model_download_init_container_fills_a_cache_pvc():
    r = render(TOGGLES["model-download"])
    dep = engine(r, "stable")
    pvc = r.one("PersistentVolumeClaim", f"{RELEASE}-kvfleet-engine-stable-model")
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert _volume(dep, "model")["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    (init,) = dep["spec"]["template"]["spec"]["initContainers"]
    env = {e["name"]: e.get("value") for e in init["env"]}
    assert env["MODEL_REPO"] == "HuggingFaceTB/SmolLM2-1.7B-Instruct"
    assert env["MODEL_DIR"] == "/models/SmolLM2-1.7B-Instruct"
    assert "snapshot_download" in init["args"][0]
    assert any(e["name"] == "HF_TOKEN" for e in init["env"])
    assert {"name": "model", "mountPath": "/models"} in init["volumeMounts"]  # writable for the init container
    # the engine itself runs offline from what was downloaded
    assert "--model=/models/SmolLM2-1.7B-Instruct" in container(dep, "engine")["args"]
    existing = render({"engineDefaults": {**TOGGLES["model-download"]["engineDefaults"],
                                          "modelSource": {"type": "download", "download": {
                                              "repo": "x/y", "cache": {"existingClaim": "shared"}}}}})
    assert not existing.of("PersistentVolumeClaim")
    assert _volume(engine(existing, "stable"), "model")["persistentVolumeClaim"]["claimName"] == "shared"


def test_download_init_script_compiles():
    init = engine(render(TOGGLES["model-download"]), "stable")["spec"]["template"]["spec"]["initContainers"][0]
    compile(init["args"][0], "download-model", "exec")


@pytest.mark.parametrize("values,message", [
    ({"engineDefaults": {"model": "/data/llama", "modelSource": {"type": "hostPath",
                                                                 "hostPath": {"path": "/mnt"}}}},
     r"pools\.stable\.model \(/data/llama\) must be a path under modelSource\.mountPath \(/models\)"),
    ({"engineDefaults": {"model": "/models/x", "modelSource": {"type": "pvc"}}},
     r"pools\.stable\.modelSource\.pvc\.claimName is required"),
    ({"engineDefaults": {"model": "/models/x", "modelSource": {"type": "download"}}},
     r"pools\.stable\.modelSource\.download\.repo is required"),
])
def test_incomplete_model_sources_fail_with_the_field_named(values, message):
    with pytest.raises(helm.HelmError, match=message):
        render(values)


def _quantity(q: str) -> float:
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def test_hpa_scales_on_kv_usage_and_waiting_requests_with_a_long_scale_down_window():
    r = render({**TOGGLES["hpa"], "pools": {"canary": {"enabled": True, "autoscaling": {
        "targetKvCacheUsage": 0.75, "targetWaitingRequests": 3, "maxReplicas": 9}}}})
    hpa = r.one("HorizontalPodAutoscaler", f"{RELEASE}-kvfleet-engine-canary")
    assert hpa["spec"]["scaleTargetRef"]["name"] == f"{RELEASE}-kvfleet-engine-canary"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 9)
    targets = {m["pods"]["metric"]["name"]: _quantity(m["pods"]["target"]["averageValue"])
               for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert targets == {"vllm_kv_cache_usage_perc": 0.75, "vllm_num_requests_waiting": 3.0}
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 600
    assert "replicas" not in engine(r, "canary")["spec"]  # the HPA owns the replica count
    assert not r.of("ScaledObject")


def test_keda_scaled_object_has_the_same_two_signals_and_no_scale_to_zero():
    r = render(TOGGLES["keda"])
    so = r.one("ScaledObject", f"{RELEASE}-kvfleet-engine-stable")
    assert so["spec"]["minReplicaCount"] >= 1
    assert so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"][
        "stabilizationWindowSeconds"] == 600
    queries = {t["name"]: t["metadata"] for t in so["spec"]["triggers"]}
    assert set(queries) == {"kv-cache-usage", "waiting-requests"}
    assert all(t["type"] == "prometheus" and t["metricType"] == "AverageValue" for t in so["spec"]["triggers"])
    svc = f"{RELEASE}-kvfleet-engine-stable"
    assert queries["kv-cache-usage"]["query"] == f'sum(vllm:kv_cache_usage_perc{{namespace="llm",service="{svc}"}})'
    assert re.fullmatch(r"sum\(vllm:num_requests_waiting\{.*\}\)", queries["waiting-requests"]["query"])
    assert (float(queries["kv-cache-usage"]["threshold"]), float(queries["waiting-requests"]["threshold"])) == (0.8, 2)
    assert not r.of("HorizontalPodAutoscaler")


def test_with_the_fair_queue_queued_requests_are_waiting_demand_and_the_router_gets_its_flags():
    r = render({**TOGGLES["keda"], "router": {"fairQueue": {"replicaSlots": 8, "timeoutSeconds": 20},
                                              "forwardPriority": True}})
    so = r.one("ScaledObject", f"{RELEASE}-kvfleet-engine-stable")
    waiting = next(t["metadata"]["query"] for t in so["spec"]["triggers"] if t["name"] == "waiting-requests")
    svc = f"{RELEASE}-kvfleet-engine-stable"
    assert waiting == (f'sum(vllm:num_requests_waiting{{namespace="llm",service="{svc}"}}) + '
                       f'(sum(kvfleet_router_queued_requests{{namespace="llm",pool="stable"}}) or vector(0))')
    args = next(c for c in r.one("Deployment", f"{RELEASE}-kvfleet-router")["spec"]["template"]["spec"]["containers"]
                if c["name"] == "router")["args"]
    assert {"--replica-slots=8", "--queue-timeout=20", "--queue-max-per-tenant=256", "--queue-max-total=1024",
            "--forward-priority"} <= set(args)



def test_with_the_fair_queue_the_hpa_counts_queued_requests_as_waiting_demand():
    r = render({**TOGGLES["hpa"], "router": {"fairQueue": {"replicaSlots": 8}}})
    hpa = r.one("HorizontalPodAutoscaler", f"{RELEASE}-kvfleet-engine-stable")
    (ext,) = [m["external"] for m in hpa["spec"]["metrics"] if m["type"] == "External"]
    assert ext["metric"] == {"name": "kvfleet_router_queued_requests", "selector": {"matchLabels": {"pool": "stable"}}}
    assert _quantity(ext["target"]["averageValue"]) == 2.0
    rules = yaml.safe_load((CHART / "files" / "prometheus-adapter-rules.yaml").read_text())["externalRules"]
    assert {x["name"]["as"] for x in rules} == {"${1}"} and "kvfleet_router_queued_requests" in rules[0]["seriesQuery"]
    assert not [m for m in render(TOGGLES["hpa"]).one("HorizontalPodAutoscaler", f"{RELEASE}-kvfleet-engine-stable")
                ["spec"]["metrics"] if m["type"] == "External"]


def test_a_pool_with_latency_targets_scales_to_the_replicas_the_routers_say_they_need():
    pools = {"stable": {"sloTtftMs": 500, "sloTpotMs": 50, "sloUnattainable": "best_effort"}}
    r = render({**TOGGLES["hpa"], "pools": pools})
    hpa = r.one("HorizontalPodAutoscaler", f"{RELEASE}-kvfleet-engine-stable")
    (ext,) = [m["external"] for m in hpa["spec"]["metrics"] if m["type"] == "External"]
    assert ext["metric"] == {"name": "kvfleet_router_pool_desired_replicas",
                             "selector": {"matchLabels": {"pool": "stable"}}}
    assert ext["target"] == {"type": "AverageValue", "averageValue": "1"}  # the metric is the desired count
    pools_file = yaml.safe_load(r.one("ConfigMap", f"{RELEASE}-kvfleet-router-pools")["data"]["pools.yaml"])
    assert {k: v for k, v in pools_file["pools"]["stable"].items() if k.startswith("slo")} == {
        "slo_ttft_ms": 500, "slo_tpot_ms": 50, "slo_unattainable": "best_effort"}
    rules = yaml.safe_load((CHART / "files" / "prometheus-adapter-rules.yaml").read_text())["externalRules"]
    (rule,) = [x for x in rules if "kvfleet_router_pool_desired_replicas" in x["seriesQuery"]]
    assert rule["metricsQuery"].startswith("max by")  # several routers: the most any of them says
    k = render({**TOGGLES["keda"], "pools": pools}).one("ScaledObject", f"{RELEASE}-kvfleet-engine-stable")
    (trigger,) = [t for t in k["spec"]["triggers"] if t["name"] == "latency-targets"]
    assert trigger["metricType"] == "AverageValue" and trigger["metadata"]["threshold"] == "1"
    assert trigger["metadata"]["query"] == 'max(kvfleet_router_pool_desired_replicas{namespace="llm",pool="stable"})'


def test_without_targets_the_desired_replicas_are_left_out_unless_asked_for():
    r = render(TOGGLES["hpa"])
    hpa = r.one("HorizontalPodAutoscaler", f"{RELEASE}-kvfleet-engine-stable")
    assert not [m for m in hpa["spec"]["metrics"] if m["type"] == "External"]
    pools_file = yaml.safe_load(r.one("ConfigMap", f"{RELEASE}-kvfleet-router-pools")["data"]["pools.yaml"])
    assert not [k for k in pools_file["pools"]["stable"] if k.startswith("slo")]
    # targets from tenants or headers: the pool asks for it
    on = render({**TOGGLES["keda"], "pools": {"stable": {"autoscaling": {"latencyTargets": True}}}})
    names = [t["name"] for t in on.one("ScaledObject", f"{RELEASE}-kvfleet-engine-stable")["spec"]["triggers"]]
    assert names == ["kv-cache-usage", "waiting-requests", "latency-targets"]
    off = render({**TOGGLES["hpa"], "pools": {"stable": {"sloTtftMs": 500, "autoscaling": {"latencyTargets": False}}}})
    hpa = off.one("HorizontalPodAutoscaler", f"{RELEASE}-kvfleet-engine-stable")
    assert not [m for m in hpa["spec"]["metrics"] if m["type"] == "External"]

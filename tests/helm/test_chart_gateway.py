"""gateway.inferencePool: per regular pool an InferencePool (v1) selecting exactly its engine pods, its endpoint
picker (`kvfleet epp` Deployment and Service, readiness from the gRPC health service), RBAC to read the pool and
watch pods, InferenceObjectives from the tenants' priorities, and one HTTPRoute from the named Gateway to the pools,
weighted as the pools are. Every object validates strictly (test_chart_validates.py: the vendored CRDs of
gateway-api-inference-extension v1.6.0 and llm-d-router v0.9.0, and Kubernetes' own schemas)."""

from __future__ import annotations

import pytest
import yaml

from tests.helm import crd_schema
from tests.helm.chart import RELEASE, TOGGLES, container, engine, render

FULL = f"{RELEASE}-kvfleet"


@pytest.fixture(scope="module")
def r():
    return render(TOGGLES["inferencepool"])


def _args(dep: dict) -> dict[str, str]:
    out = {}
    for a in container(dep, "epp")["args"][1:]:
        k, _, v = a.partition("=")
        out[k] = v
    return out


def test_off_by_default():
    kinds = {m["kind"] for m in render({}).manifests}
    assert not kinds & {"InferencePool", "InferenceObjective"}
    assert not [m for m in render({}).manifests if "epp" in m["metadata"]["name"]]


def test_each_regular_pool_is_an_inference_pool_of_exactly_its_engine_pods(r):
    pools = {m["metadata"]["name"]: m for m in r.of("InferencePool")}
    assert sorted(pools) == [f"{FULL}-engine-canary", f"{FULL}-engine-stable"]  # the long-context pool is not
    for pool in ("stable", "canary"):
        ip = pools[f"{FULL}-engine-{pool}"]
        pod_labels = engine(r, pool)["spec"]["template"]["metadata"]["labels"]
        selector = ip["spec"]["selector"]["matchLabels"]
        assert selector.items() <= pod_labels.items() and selector["kvfleet.dev/pool"] == pool
        assert ip["spec"]["targetPorts"] == [{"number": 8000}]
        assert ip["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service", "name": f"{FULL}-epp-{pool}",
                                                   "port": {"number": 9002}, "failureMode": "FailClose"}
        svc = r.one("Service", f"{FULL}-epp-{pool}")
        assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": 9002, "metrics": 9090}
        dep = r.one("Deployment", f"{FULL}-epp-{pool}")
        assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
        assert dep["spec"]["template"]["metadata"]["labels"].items() >= svc["spec"]["selector"].items()
        args = _args(dep)
        assert args["--inference-pool"] == ip["metadata"]["name"] and args["--port"] == "9002"
        assert args["--objectives"] == "/etc/kvfleet/objectives.yaml" and "--tenants" in args
        c = container(dep, "epp")
        assert c["readinessProbe"]["grpc"] == {"port": 9002, "service": "readiness"}
        assert c["livenessProbe"]["grpc"] == {"port": 9002, "service": "liveness"}
        assert dep["spec"]["template"]["spec"]["serviceAccountName"] == f"{FULL}-epp"


def test_the_picker_may_read_its_pool_and_watch_pods_and_nothing_else(r):
    role = r.one("Role", f"{FULL}-epp")
    assert role["rules"] == [{"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"],
                              "verbs": ["get", "list", "watch"]},
                             {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = r.one("RoleBinding", f"{FULL}-epp")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": f"{FULL}-epp", "namespace": "llm"}]
    assert binding["roleRef"]["name"] == f"{FULL}-epp"


def test_the_http_route_sends_the_gateway_to_the_pools_by_weight(r):
    route = r.one("HTTPRoute", f"{FULL}-inference")
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                            "name": "inference-gateway", "namespace": "gateway-system"}]
    assert route["spec"]["hostnames"] == ["llm.example.com"]
    rule = route["spec"]["rules"][0]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": f"{FULL}-engine-canary", "weight": 5},
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": f"{FULL}-engine-stable",
         "weight": 95}]


def test_objectives_from_tenant_priorities_and_values_and_the_picker_reads_the_same(r):
    objs = {m["metadata"]["name"]: m["spec"] for m in r.of("InferenceObjective")}
    assert objs[f"{FULL}-engine-stable-acme"] == {"poolRef": {"group": "inference.networking.k8s.io",
                                                             "kind": "InferencePool", "name": f"{FULL}-engine-stable"},
                                                 "priority": 5}
    assert objs[f"{FULL}-engine-canary-batch"]["priority"] == -10
    assert len(objs) == 4
    from router.epp.objectives import objectives_from

    data = r.one("ConfigMap", f"{FULL}-epp-stable-objectives")["data"]["objectives.yaml"]
    assert objectives_from(yaml.safe_load_all(data)) == {f"{FULL}-engine-stable-acme": 5,
                                                         f"{FULL}-engine-stable-batch": -10}


def test_a_vllm_pool_gets_a_picker_reading_its_kv_events_and_fail_open_is_passed_on():
    r = render(TOGGLES["inferencepool-mixed"])
    for ip in r.of("InferencePool"):
        assert ip["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
        assert crd_schema.errors(ip) == []
    engines = {d["metadata"]["name"]: _args(d)["--engine-type"] for d in r.of("Deployment") if "-epp-" in d["metadata"]["name"]}
    assert "vllm" in engines.values() and "kvfleet" in engines.values()
    vllm = next(d for d in r.of("Deployment") if "-epp-" in d["metadata"]["name"] and _args(d)["--engine-type"] == "vllm")
    assert _args(vllm)["--vllm-kv-events"] == "tcp://{host}:5557|tcp://{host}:5558"


@pytest.mark.parametrize("values, message", [
    ({"gateway": {"inferencePool": {"enabled": True}}}, "gatewayRef.name"),
    ({"gateway": {"inferencePool": {"enabled": True, "gatewayRef": {"name": "gw"}, "failureMode": "Open"}}},
     "failureMode"),
    ({"gateway": {"inferencePool": {"enabled": True, "gatewayRef": {"name": "gw"}, "epp": {"port": 0}}}}, "port"),
])
def test_bad_values_are_refused_naming_the_field(values, message):
    with pytest.raises(Exception, match=message):
        render(values)


def test_the_crd_check_is_not_vacuous_for_inference_pools(r):
    ip = r.of("InferencePool")[0]
    bad = {**ip, "spec": {**ip["spec"], "targetPort": ip["spec"]["targetPorts"]}}
    assert any("targetPort" in e for e in crd_schema.errors(bad))
    nine = {**ip, "spec": {**ip["spec"], "targetPorts": [{"number": 8000 + i} for i in range(9)]}}
    assert any(e.startswith("spec.targetPorts") for e in crd_schema.errors(nine))


def test_with_network_policies_pickers_and_the_gateway_reach_the_engines():
    r = render(TOGGLES["inferencepool-networkpolicy"])
    rules = r.one("NetworkPolicy", f"{FULL}-engines")["spec"]["ingress"]
    froms = [rule.get("from") for rule in rules]
    assert [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvfleet", "app.kubernetes.io/instance": RELEASE,
                                             "app.kubernetes.io/component": "epp"}}}] in froms
    assert [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway-system"}}}] in froms
    assert not [rule for rule in render({"networkPolicy": {"enabled": True}}).one(
        "NetworkPolicy", f"{FULL}-engines")["spec"]["ingress"] if "from" not in rule]

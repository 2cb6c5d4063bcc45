"""The routers the chart renders: Deployment (>= 2, PDB, Service), pools file mounted so that updates arrive,
discovery RBAC, tenants, Redis (chart's own or external), Ingress/HTTPRoute, NetworkPolicy, helm test hook."""

from __future__ import annotations

import helm_python as helm
import pytest

from tests.helm.chart import RELEASE, TOGGLES, container, render, router

ROUTER = f"{RELEASE}-kvfleet-router"


def _env(c):
    return {e["name"]: e for e in c["env"]}


def test_router_deployment_service_and_pdb():
    r = render()
    dep = router(r)
    c = container(dep, "router")
    assert dep["spec"]["replicas"] >= 2
    assert r.one("PodDisruptionBudget", ROUTER)["spec"]["minAvailable"] == 1
    assert r.one("Service", ROUTER)["spec"]["ports"][0]["targetPort"] == "http"
    assert "--pools=/etc/kvfleet/pools.yaml" in c["args"] and "--model=smollm2" in c["args"]
    assert "--tokenizer-from-engines" in c["args"]  # no model files on routers by default
    assert not [a for a in c["args"] if a.startswith("--default-model")]  # a request names its model (else 400)
    filled = container(router(render({"router": {"defaultModel": "smollm2"}})), "router")
    assert "--default-model=smollm2" in filled["args"]
    assert _env(c)["KVFLEET_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == \
        f"{RELEASE}-kvfleet-internal-token"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert "--drain-timeout=30" in c["args"]  # streams get 30 s after SIGTERM, inside the 60 s grace period
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 60
    secret = r.one("Secret", f"{RELEASE}-kvfleet-internal-token")
    assert len(secret["data"]["token"]) >= 48


def test_pools_file_is_mounted_as_a_directory_without_a_checksum_so_updates_reach_running_routers():
    dep = router(render(TOGGLES["redis-chart"]))
    c = container(dep, "router")
    mount = next(m for m in c["volumeMounts"] if m["name"] == "config")
    assert mount["mountPath"] == "/etc/kvfleet" and "subPath" not in mount  # subPath mounts never update
    vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    sources = vol["projected"]["sources"]
    assert sources[0]["configMap"]["items"] == [{"key": "pools.yaml", "path": "pools.yaml"}]
    assert sources[1]["secret"]["items"] == [{"key": "tenants.yaml", "path": "tenants.yaml"}]
    assert "--tenants=/etc/kvfleet/tenants.yaml" in c["args"]
    assert not any("checksum" in k for k in (dep["spec"]["template"]["metadata"].get("annotations") or {}))


def test_k8s_discovery_gets_a_role_to_watch_endpointslices_and_dns_discovery_none():
    r = render()
    role = r.one("Role", ROUTER)
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    assert r.one("RoleBinding", ROUTER)["subjects"][0]["name"] == ROUTER
    assert router(r)["spec"]["template"]["spec"]["serviceAccountName"] == ROUTER
    dns = render(TOGGLES["dns-discovery"])
    assert not dns.of("Role") and router(dns)["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_chart_redis_serves_the_routers_budgets():
    r = render(TOGGLES["redis-chart"])
    redis = r.one("Deployment", f"{RELEASE}-kvfleet-redis")
    assert container(redis, "redis")["securityContext"]["allowPrivilegeEscalation"] is False
    r.one("Service", f"{RELEASE}-kvfleet-redis")
    url = _env(container(router(r), "router"))["KVFLEET_REDIS_URL"]["value"]
    assert url == f"redis://{RELEASE}-kvfleet-redis:6379/0"
    tenants = r.one("Secret", f"{RELEASE}-kvfleet-tenants")
    assert "tokens_per_minute: 20000" in tenants["stringData"]["tenants.yaml"]


def test_external_redis_url_travels_in_a_secret_and_no_redis_is_deployed():
    r = render(TOGGLES["redis-external"])
    assert not [m for m in r.of("Deployment") if "redis" in m["metadata"]["name"]]
    ref = _env(container(router(r), "router"))["KVFLEET_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    assert r.one("Secret", ref["name"])["stringData"][ref["key"]] == "redis://redis.infra:6379/3"
    assert not [s for s in r.of("Secret") if s["metadata"]["name"].endswith("-tenants")]  # existingSecret
    given = render({**TOGGLES["redis-external"], "redis": {"mode": "external",
                                                           "external": {"existingSecret": "redis-creds"}}})
    ref = _env(container(router(given), "router"))["KVFLEET_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "redis-creds", "key": "url"}


def test_no_redis_without_tenants():
    r = render({"redis": {"mode": "chart"}})
    assert not [m for m in r.of("Deployment") if "redis" in m["metadata"]["name"]]
    assert "KVFLEET_REDIS_URL" not in _env(container(router(r), "router"))


@pytest.mark.parametrize("values,message", [
    ({"router": {"tenants": {"enabled": True}}}, r"router\.tenants\.config .* or router\.tenants\.existingSecret"),
    ({"router": {"tenants": {"enabled": True, "existingSecret": "t"}}, "redis": {"mode": "external"}},
     r"redis\.mode external needs redis\.external\.url"),
    ({"router": {"httpRoute": {"enabled": True}}}, r"router\.httpRoute\.parentRefs"),
    ({"router": {"drainTimeoutSeconds": 60}}, r"router\.terminationGracePeriodSeconds \(60\) must exceed "
     r"router\.drainTimeoutSeconds \+ router\.preStopSleepSeconds \(65\)"),
    ({"router": {"model": "/data/m", "modelSource": {"type": "pvc", "pvc": {"claimName": "m"}}}},
     r"router\.model \(/data/m\) must be a path under router\.modelSource\.mountPath"),
])
def test_incomplete_router_settings_fail_with_the_field_named(values, message):
    with pytest.raises(helm.HelmError, match=message):
        render(values)


def test_router_mounts_a_non_bundled_model_read_only_for_its_tokenizer():
    c = container(router(render(TOGGLES["model-pvc"])), "router")
    assert "--model=/models/llama" in c["args"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True, "subPath": "hf"} in c["volumeMounts"]


def test_ingress_and_httproute_expose_only_the_api():
    ing = render(TOGGLES["ingress"]).one("Ingress", ROUTER)
    paths = ing["spec"]["rules"][0]["http"]["paths"]
    assert [(p["path"], p["backend"]["service"]["name"]) for p in paths] == [("/v1", ROUTER)]
    assert ing["spec"]["ingressClassName"] == "nginx" and ing["spec"]["tls"][0]["secretName"] == "tls"
    route = render(TOGGLES["httproute"]).one("HTTPRoute", ROUTER)
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    assert rule["backendRefs"] == [{"name": ROUTER, "port": 80}]
    assert route["spec"]["parentRefs"] == [{"name": "gw", "namespace": "gateway-system"}]


def _policy(r, suffix):
    return r.one("NetworkPolicy", f"{RELEASE}-kvfleet-{suffix}")


def test_network_policy_lets_only_routers_and_prometheus_reach_engines():
    r = render(TOGGLES["networkpolicy"])
    engines = _policy(r, "engines")["spec"]
    assert engines["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "engine"
    peers = [rule["from"] for rule in engines["ingress"]]
    assert peers[0] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvfleet",
                                                         "app.kubernetes.io/instance": RELEASE,
                                                         "app.kubernetes.io/component": "router"}}}]
    assert peers[1][0]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
    assert peers[1][0]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    assert len(peers) == 2
    redis = _policy(r, "redis")["spec"]
    assert redis["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    # routers: open on their port unless clients are listed
    assert _policy(r, "routers")["spec"]["ingress"] == [{"ports": [{"port": "http", "protocol": "TCP"}]}]
    listed = _policy(render(TOGGLES["networkpolicy-clients"]), "routers")["spec"]["ingress"][0]["from"]
    assert listed[0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "ingress-nginx"}
    assert any(p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") == "test"
               for p in listed)  # the helm test pod still gets through
    assert not render().of("NetworkPolicy")


def test_helm_test_hook_pod_sends_a_chat_request_to_the_router_service():
    pod = next(m for m in render().of("Pod"))
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    c = pod["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["ROUTER_URL"] == f"http://{ROUTER}:80" and env["MODEL"] == "smollm2"
    assert "/v1/chat/completions" in c["args"][0]

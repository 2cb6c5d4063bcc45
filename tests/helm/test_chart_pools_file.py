"""The router's pools file that the chart renders (ConfigMap <release>-kvfleet-router-pools) has the structure
of /work/notes/pools.md, the format `kvfleet router --pools` reads; checked field by field here until the
router's own parser can load it in this test."""

from __future__ import annotations

import pytest

from tests.helm.chart import ALL_POOLS, NAMESPACE, RELEASE, TOGGLES, pools_file, render

POOL_FIELDS = {"version", "weight", "canary", "long_context", "replicas", "dns", "k8s", "max_tokens_cap",
               "default_max_tokens", "max_context_tokens"}
DEGRADATION_FIELDS = {"window_s", "min_requests", "interval_s", "dwell_s", "max_tokens_factor", "p99_ttft_s",
                      "p99_tpot_s", "error_rate", "oom_events", "kv_usage"}


def structure_errors(doc) -> list[str]:
    """Every way `doc` departs from the pools file format (pools.md)."""
    errs = []
    if not isinstance(doc, dict) or not isinstance(doc.get("pools"), dict) or not doc["pools"]:
        return ["pools: a non-empty mapping is required"]
    errs += [f"{k}: unknown top-level key" for k in set(doc) - {"pools", "degradation"}]
    for name, p in doc["pools"].items():
        at = f"pools.{name}"
        errs += [f"{at}.{k}: unknown field" for k in set(p) - POOL_FIELDS]
        if not isinstance(p.get("version"), str) or not p["version"]:
            errs.append(f"{at}.version: a non-empty string is required")
        if type(p.get("weight")) is not int or p["weight"] < 0:
            errs.append(f"{at}.weight: an integer >= 0 is required")
        sources = [k for k in ("replicas", "dns", "k8s") if k in p]
        if len(sources) != 1:
            errs.append(f"{at}: exactly one discovery source, got {sources}")
        if "dns" in p and (set(p["dns"]) != {"name", "port"} or type(p["dns"]["port"]) is not int):
            errs.append(f"{at}.dns: {{name, port}} required")
        if "k8s" in p and set(p["k8s"]) != {"service", "namespace", "port_name"}:
            errs.append(f"{at}.k8s: {{service, namespace, port_name}} required")
        for k in ("max_tokens_cap", "default_max_tokens", "max_context_tokens"):
            if k in p and (type(p[k]) is not int or p[k] < 1):
                errs.append(f"{at}.{k}: a positive integer is required")
        for k in ("canary", "long_context"):
            if k in p and type(p[k]) is not bool:
                errs.append(f"{at}.{k}: a boolean is required")
    deg = doc.get("degradation", {})
    errs += [f"degradation.{k}: unknown field" for k in set(deg) - DEGRADATION_FIELDS]
    return errs


def test_the_checker_rejects_what_the_format_forbids():
    assert structure_errors({"pools": {"a": {"version": "v1", "weight": -1, "dns": {"name": "x"},
                                             "k8s": {"service": "s"}, "max_tokens_cap": 0, "canary": "yes",
                                             "wieght": 1}}, "degradaton": {}}) == [
        "degradaton: unknown top-level key", "pools.a.wieght: unknown field",
        "pools.a.weight: an integer >= 0 is required", "pools.a: exactly one discovery source, got ['dns', 'k8s']",
        "pools.a.dns: {name, port} required", "pools.a.k8s: {service, namespace, port_name} required",
        "pools.a.max_tokens_cap: a positive integer is required", "pools.a.canary: a boolean is required"]


@pytest.mark.parametrize("toggle", sorted(TOGGLES))
def test_rendered_pools_file_has_the_documented_structure(toggle):
    assert structure_errors(pools_file(render(TOGGLES[toggle]))) == []


def test_pools_carry_weights_flags_limits_and_k8s_discovery():
    doc = pools_file(render({**ALL_POOLS, "pools": {**ALL_POOLS["pools"], "stable": {"maxTokensCap": 4096,
                                                                                     "defaultMaxTokens": 512}}}))
    svc = f"{RELEASE}-kvfleet-engine"
    assert doc == {"pools": {
        "stable": {"version": "v1", "weight": 95, "max_tokens_cap": 4096, "default_max_tokens": 512,
                   "k8s": {"service": f"{svc}-stable", "namespace": NAMESPACE, "port_name": "http"}},
        "canary": {"version": "v2", "weight": 5, "canary": True,
                   "k8s": {"service": f"{svc}-canary", "namespace": NAMESPACE, "port_name": "http"}},
        "long": {"version": "v1", "weight": 1, "long_context": True, "max_context_tokens": 32768,
                 "k8s": {"service": f"{svc}-long", "namespace": NAMESPACE, "port_name": "http"}}}}


def test_dns_discovery_names_the_headless_services_and_degradation_passes_through():
    doc = pools_file(render({"router": {"discovery": "dns", "degradation": {
        "window_s": 60, "p99_ttft_s": {"trip": 3.0, "clear": 1.5}}}}))
    assert doc["pools"]["stable"]["dns"] == {"name": f"{RELEASE}-kvfleet-engine-stable.{NAMESPACE}.svc.cluster.local",
                                             "port": 8000}
    assert doc["degradation"] == {"window_s": 60, "p99_ttft_s": {"trip": 3.0, "clear": 1.5}}


def test_max_context_tokens_is_also_the_engines_max_model_len():
    r = render(ALL_POOLS)
    long_args = next(m for m in r.of("Deployment") if m["metadata"]["name"].endswith("engine-long"))[
        "spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--max-model-len=32768" in long_args


def test_weight_change_alone_touches_only_the_configmap():
    """A weight change (or its rollback) changes the pools file and nothing that would restart a pod."""
    before = render(ALL_POOLS)
    after = render({"pools": {"canary": {"enabled": True, "weight": 50}, "long": {"enabled": True}}})
    changed = [a["metadata"]["name"] for a, b in zip(before.manifests, after.manifests, strict=True)
               if a != b and a["kind"] != "Secret"]  # the token is random per offline render
    assert changed == [f"{RELEASE}-kvfleet-router-pools"]
    assert pools_file(after)["pools"]["canary"]["weight"] == 50


@pytest.mark.parametrize("values,message", [
    ({"pools": {"stable": {"enabled": False}}}, "enable at least one engine pool"),
    ({"pools": {"stable": {"weight": 0}}}, "at least one enabled pool that is not longContext needs weight > 0"),
])
def test_pool_sets_the_router_cannot_route_are_refused(values, message):
    import helm_python as helm
    with pytest.raises(helm.HelmError, match=message):
        render(values)

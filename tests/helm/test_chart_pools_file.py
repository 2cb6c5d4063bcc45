"""The router's pools file that the chart renders (ConfigMap <release>-kvfleet-router-pools): the router's own
parser (router/pools/file.py, what `kvfleet router --pools` reads) loads it under every toggle."""

from __future__ import annotations

import pytest
import yaml

from router.pools.file import parse_pools
from tests.helm.chart import ALL_POOLS, NAMESPACE, RELEASE, TOGGLES, pools_file, render


@pytest.mark.parametrize("toggle", sorted(TOGGLES))
def test_the_router_loads_the_rendered_pools_file(toggle):
    cfg = parse_pools(yaml.safe_dump(pools_file(render(TOGGLES[toggle]))), "pools.yaml")
    assert any(p.spec.weight > 0 and not p.spec.long_context for p in cfg.pools)


def test_pools_carry_weights_flags_limits_and_k8s_discovery():
    doc = pools_file(render({**ALL_POOLS, "pools": {**ALL_POOLS["pools"], "stable": {"maxTokensCap": 4096,
                                                                                     "defaultMaxTokens": 512}}}))
    svc = f"{RELEASE}-kvfleet-engine"
    model = {"model": "smollm2", "engine": "kvfleet"}  # every pool names its model and engine
    assert doc == {"pools": {
        "stable": {"version": "v1", "weight": 95, "max_tokens_cap": 4096, "default_max_tokens": 512, **model,
                   "k8s": {"service": f"{svc}-stable", "namespace": NAMESPACE, "port_name": "http"}},
        "canary": {"version": "v2", "weight": 5, "canary": True, **model,
                   "k8s": {"service": f"{svc}-canary", "namespace": NAMESPACE, "port_name": "http"}},
        "long": {"version": "v1", "weight": 1, "long_context": True, "max_context_tokens": 32768, **model,
                 "k8s": {"service": f"{svc}-long", "namespace": NAMESPACE, "port_name": "http"}}}}


def test_prefill_and_decode_roles_reach_the_pools_file():
    doc = pools_file(render({"pools": {"stable": {"role": "decode"}, "canary": {"enabled": True, "role": "prefill",
                                                                               "weight": 1}}}))
    assert doc["pools"]["stable"]["role"] == "decode" and doc["pools"]["canary"]["role"] == "prefill"
    cfg = parse_pools(yaml.safe_dump(doc), "pools.yaml")
    assert {p.spec.name: p.spec.role for p in cfg.pools} == {"stable": "decode", "canary": "prefill"}
    assert "role" not in pools_file(render({}))["pools"]["stable"]  # both: the default, not written


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
    ({"pools": {"stable": {"role": "prefill"}}}, "at least one enabled pool that is not longContext needs weight > 0"),
])
def test_pool_sets_the_router_cannot_route_are_refused(values, message):
    import helm_python as helm
    with pytest.raises(helm.HelmError, match=message):
        render(values)

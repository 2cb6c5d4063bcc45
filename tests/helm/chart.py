"""Render the chart through Helm's own SDK (helm-python-sdk: Helm v4's Go library, bundled in the wheel) and
parse what comes out."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvfleet"
RELEASE, NAMESPACE = "demo", "llm"
# Kubernetes versions the manifests are validated for: the chart's kubeVersion floor and the newest schema
# kubernetes-validate ships.
KUBE_VERSIONS = ("1.30", "1.37")


@dataclass(frozen=True)
class Rendered:
    manifests: list[dict]  # every rendered object, hooks (helm test) included
    notes: str

    def of(self, kind: str) -> list[dict]:
        return [m for m in self.manifests if m["kind"] == kind]

    def one(self, kind: str, name: str) -> dict:
        found = [m for m in self.of(kind) if m["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind}/{name}: found {len(found)} among {self.names()}"
        return found[0]

    def names(self) -> list[str]:
        return sorted(f"{m['kind']}/{m['metadata']['name']}" for m in self.manifests)


def render(values: dict | None = None, chart: Path = CHART) -> Rendered:
    with helm.Chart.load(str(chart)) as c:
        out = c.render(copy.deepcopy(values or {}), name=RELEASE, namespace=NAMESPACE, is_install=True)
    manifests = [doc for path, text in sorted(out.items()) if not path.endswith("NOTES.txt")
                 for doc in yaml.safe_load_all(text) if doc]
    notes = next((text for path, text in out.items() if path.endswith("NOTES.txt")), "")
    return Rendered(manifests, notes)


def container(deployment: dict, name: str) -> dict:
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def engine(r: Rendered, pool: str) -> dict:
    return r.one("Deployment", f"{RELEASE}-kvfleet-engine-{pool}")


def router(r: Rendered) -> dict:
    return r.one("Deployment", f"{RELEASE}-kvfleet-router")


def pools_file(r: Rendered) -> dict:
    return yaml.safe_load(r.one("ConfigMap", f"{RELEASE}-kvfleet-router-pools")["data"]["pools.yaml"])


# Values that switch every feature on, each toggle a name the tests iterate over.
TENANTS = {"tenants": {"acme": {"api_key_sha256": ["a" * 64], "tokens_per_minute": 20000}}}
ALL_POOLS = {"pools": {"canary": {"enabled": True}, "long": {"enabled": True}}}
# Several models in one release, one pool per engine: kvfleet (the bundled SmolLM2), vLLM with tensor parallelism
# over 4 GPUs (model on a PVC that the routers mount too, for its tokenizer) and SGLang (model downloaded).
MIXED = {
    "hashSeed": 12345,
    "router": {"model": "/models/SmolLM2-135M-Instruct", "modelSource": {"type": "pvc", "pvc": {"claimName": "models"}}},
    "pools": {
        "stable": {"enabled": False},
        "small": {"version": "v1", "weight": 100},
        "large": {"version": "v1", "weight": 100, "engine": "vllm", "gpus": 4, "servedModelName": "llama-3.3-70b",
                  "model": "/models/Llama-3.3-70B-Instruct", "maxContextTokens": 32768,
                  "modelSource": {"type": "pvc", "pvc": {"claimName": "models"}},
                  "routerTokenizer": "/models/Llama-3.3-70B-Instruct",
                  "vllm": {"extraArgs": ["--gpu-memory-utilization", "0.92"]}},
        "medium": {"version": "v1", "weight": 100, "engine": "sglang", "servedModelName": "qwen2.5-7b",
                   "model": "/models/Qwen2.5-7B-Instruct", "maxContextTokens": 16384,
                   "modelSource": {"type": "download", "download": {"repo": "Qwen/Qwen2.5-7B-Instruct"}},
                   "sglang": {"pageSize": 32, "extraArgs": ["--mem-fraction-static", "0.85"]}},
    },
}
MIXED_ALL_ON = {**MIXED, "engineDefaults": {"autoscaling": {"enabled": True}}, "networkPolicy": {"enabled": True},
                "monitoring": {"serviceMonitors": {"enabled": True}, "prometheusRule": {"enabled": True}}}
TOGGLES: dict[str, dict] = {
    "default": {},
    "all-pools": ALL_POOLS,
    "hpa": {**ALL_POOLS, "engineDefaults": {"autoscaling": {"enabled": True}},
            "autoscaling": {"mode": "hpa", "hpa": {"adapterRulesConfigMap": True}}},
    "keda": {**ALL_POOLS, "engineDefaults": {"autoscaling": {"enabled": True}}, "autoscaling": {"mode": "keda"}},
    "redis-chart": {"router": {"tenants": {"enabled": True, "config": TENANTS}}, "redis": {"mode": "chart"}},
    "redis-external": {"router": {"tenants": {"enabled": True, "existingSecret": "my-tenants"}},
                       "redis": {"mode": "external", "external": {"url": "redis://redis.infra:6379/3"}}},
    "model-pvc": {"engineDefaults": {"model": "/models/llama", "modelSource": {
                      "type": "pvc", "pvc": {"claimName": "models", "subPath": "hf"}}},
                  "router": {"model": "/models/llama", "modelSource": {
                      "type": "pvc", "pvc": {"claimName": "models", "subPath": "hf"}}}},
    "model-hostpath": {"engineDefaults": {"model": "/models/llama", "modelSource": {
                           "type": "hostPath", "hostPath": {"path": "/mnt/models"}}},
                       "router": {"model": "/models/llama", "modelSource": {
                           "type": "hostPath", "hostPath": {"path": "/mnt/models"}}}},
    "model-download": {"engineDefaults": {"model": "/models/SmolLM2-1.7B-Instruct", "modelSource": {
                           "type": "download", "download": {"repo": "HuggingFaceTB/SmolLM2-1.7B-Instruct",
                                                            "tokenSecret": {"name": "hf"}}}}},
    "ingress": {"router": {"ingress": {"enabled": True, "className": "nginx",
                                       "tls": [{"hosts": ["kvfleet.example.com"], "secretName": "tls"}]}}},
    "httproute": {"router": {"httpRoute": {"enabled": True, "hostnames": ["kvfleet.example.com"],
                                           "parentRefs": [{"name": "gw", "namespace": "gateway-system"}]}}},
    "networkpolicy": {"networkPolicy": {"enabled": True}, "router": {"tenants": {"enabled": True,
                                                                              "config": TENANTS}}},
    "networkpolicy-clients": {"networkPolicy": {"enabled": True, "routerFrom": [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}]}},
    "dns-discovery": {"router": {"discovery": "dns"}, "hashSeed": 12345},
    "monitoring": {"monitoring": {"serviceMonitors": {"enabled": True, "labels": {"release": "kps"}},
                                  "prometheusRule": {"enabled": True}, "dashboards": {"enabled": True}}},
    "mixed-hpa": {**MIXED_ALL_ON, "autoscaling": {"mode": "hpa", "hpa": {"adapterRulesConfigMap": True}}},
    "mixed-keda": {**MIXED_ALL_ON, "autoscaling": {"mode": "keda"}},
    "latency-targets-hpa": {**ALL_POOLS, "engineDefaults": {"autoscaling": {"enabled": True}, "sloTtftMs": 800,
                                                             "sloTpotMs": 60},
                            "autoscaling": {"mode": "hpa", "hpa": {"adapterRulesConfigMap": True}}},
    "latency-targets-keda": {**ALL_POOLS, "engineDefaults": {"autoscaling": {"enabled": True, "latencyTargets": True}},
                             "autoscaling": {"mode": "keda"}},
    "fair-queue-hpa": {**ALL_POOLS, "engineDefaults": {"autoscaling": {"enabled": True}},
                       "autoscaling": {"mode": "hpa"}, "router": {"fairQueue": {"replicaSlots": 8},
                                                                  "forwardPriority": True}},
    "inferencepool": {**ALL_POOLS, "gateway": {"inferencePool": {
        "enabled": True, "gatewayRef": {"name": "inference-gateway", "namespace": "gateway-system"},
        "hostnames": ["llm.example.com"], "objectives": {"batch": -10}}},
        "router": {"tenants": {"enabled": True, "config": {"tenants": {
            "acme": {"api_key_sha256": ["a" * 64], "tokens_per_minute": 20000, "priority": 5}}}}}},
    "inferencepool-networkpolicy": {"networkPolicy": {"enabled": True, "gatewayFrom": [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway-system"}}}]},
        "gateway": {"inferencePool": {"enabled": True, "gatewayRef": {"name": "gw"}}}},
    "inferencepool-mixed": {**MIXED, "gateway": {"inferencePool": {"enabled": True, "failureMode": "FailOpen",
                                                                    "gatewayRef": {"name": "gw"}}}},
    "fair-queue-keda": {**ALL_POOLS, "engineDefaults": {"autoscaling": {"enabled": True}},
                        "autoscaling": {"mode": "keda"}, "router": {"fairQueue": {"replicaSlots": 8}}},
}

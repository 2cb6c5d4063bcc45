"""Several models in one release, any engine per pool (chart.MIXED): a kvfleet pool, a vLLM pool with tensor
parallelism over 4 GPUs and an SGLang pool. The engines' exact command lines, their writable paths under a
read-only root, KV events wired from engines to routers (ports, Service, NetworkPolicy, pools file), and each
engine's own metric names in autoscaling, scraping and rules. (Strict Kubernetes and CRD validation of these
manifests: the `mixed-*` toggles of test_chart_validates.py.)"""

from __future__ import annotations

import json
import shutil

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from router.pools.file import parse_pools
from tests.helm.chart import (
    CHART,
    KUBE_VERSIONS,
    MIXED,
    NAMESPACE,
    RELEASE,
    ROOT,
    TOGGLES,
    container,
    engine,
    pools_file,
    render,
)

SVC = f"{RELEASE}-kvfleet-engine"
KV_EVENTS = {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}


def _env(c: dict) -> dict:
    return {e["name"]: e.get("value") for e in c["env"]}


def _kv_events_config(args: list[str]) -> dict:
    (flag,) = [a for a in args if a.startswith("--kv-events-config=")]
    return json.loads(flag.split("=", 1)[1])


def _volumes(dep: dict) -> dict:
    return {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}


def test_vllm_pool_runs_vllm_serve_with_tensor_parallelism_and_zmq_kv_events():
    dep = engine(render(MIXED), "large")
    c = container(dep, "engine")
    assert c["image"] == "vllm/vllm-openai:v0.11.0" and c["command"] == ["vllm", "serve"]
    args = c["args"]
    assert args == ["--model=/models/Llama-3.3-70B-Instruct", "--served-model-name=llama-3.3-70b", "--host=0.0.0.0",
                    "--port=8000", "--tensor-parallel-size=4", "--max-model-len=32768",
                    "--prefix-caching-hash-algo=sha256_cbor", "--enable-prompt-tokens-details",
                    args[8], "--gpu-memory-utilization", "0.92"]
    assert _kv_events_config(args) == {"enable_kv_cache_events": True, **KV_EVENTS}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4 == c["resources"]["requests"]["nvidia.com/gpu"]
    # kvfleet's internal token is kvfleet's: vLLM gets neither the flag nor the secret
    assert not any("internal-token" in a or "drain-timeout" in a for a in args)
    assert "KVFLEET_INTERNAL_TOKEN" not in _env(c)
    # hashSeed: vLLM seeds its first block hash from PYTHONHASHSEED
    assert _env(c)["PYTHONHASHSEED"] == "12345"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8000, "kv-events": 5557, "kv-replay": 5558}
    assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert _volumes(dep)["shm"] == {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}
    assert dep["metadata"]["labels"]["kvfleet.dev/engine"] == "vllm"


def test_sglang_pool_runs_launch_server_with_pages_metrics_and_zmq_kv_events():
    dep = engine(render(MIXED), "medium")
    c = container(dep, "engine")
    assert c["image"] == "lmsysorg/sglang:v0.5.5"
    assert c["command"] == ["python3", "-m", "sglang.launch_server"]
    args = c["args"]
    assert args == ["--model-path=/models/Qwen2.5-7B-Instruct", "--served-model-name=qwen2.5-7b", "--host=0.0.0.0",
                    "--port=8000", "--tp-size=1", "--page-size=32", "--context-length=16384", "--enable-metrics",
                    args[8], "--mem-fraction-static", "0.85"]
    assert _kv_events_config(args) == KV_EVENTS  # SGLang's config has no enable flag: the publisher turns them on
    assert "KVFLEET_INTERNAL_TOKEN" not in _env(c) and "PYTHONHASHSEED" not in _env(c)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert _volumes(dep)["shm"]["emptyDir"]["medium"] == "Memory"
    # the download init container (kvfleet's image, huggingface_hub) fills the cache PVC SGLang reads
    (init,) = dep["spec"]["template"]["spec"]["initContainers"]
    assert init["image"].startswith("ghcr.io/kvfleet/kvfleet-engine:") and _env(init)["MODEL_DIR"] == \
        "/models/Qwen2.5-7B-Instruct"


@pytest.mark.parametrize("pool", ["large", "medium"])
def test_vllm_and_sglang_write_only_to_their_emptydirs_under_a_read_only_root(pool):
    dep = engine(render(MIXED), pool)
    c = container(dep, "engine")
    spec = dep["spec"]["template"]["spec"]
    assert c["securityContext"]["readOnlyRootFilesystem"] and spec["securityContext"]["runAsNonRoot"]
    writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")
                if "emptyDir" in _volumes(dep)[m["name"]]}
    assert writable == {"/cache", "/tmp", "/dev/shm"}
    env = _env(c)
    paths = {k: v for k, v in env.items() if v and v.startswith("/")}
    assert {"HOME", "XDG_CACHE_HOME", "HF_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"} <= set(paths)
    assert all(v.startswith("/cache/") for v in paths.values()), paths
    assert env["HF_HUB_OFFLINE"] == "1"  # the model is on its volume; nothing is fetched at start


def test_kvfleet_pool_beside_them_is_unchanged_but_for_its_own_served_name():
    r = render({**MIXED, "pools": {**MIXED["pools"], "small": {"version": "v1", "weight": 100,
                                                                 "servedModelName": "smol"}}})
    c = container(engine(r, "small"), "engine")
    assert c["args"][:4] == ["engine", "--model=smollm2", "--served-model-name=smol", "--host=0.0.0.0"]
    assert "--require-internal-token" in c["args"] and "--hash-seed=12345" in c["args"]
    assert "command" not in c and [p["name"] for p in c["ports"]] == ["http"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert "shm" not in _volumes(engine(r, "small"))
    # and the default release renders the kvfleet engine exactly as before
    default = container(engine(render(), "stable"), "engine")
    assert default["image"].startswith("ghcr.io/kvfleet/kvfleet-engine:") and "command" not in default
    assert "--served-model-name=smollm2" in default["args"]


def test_engine_default_applies_to_every_pool_that_does_not_choose():
    r = render({"engineDefaults": {"engine": "vllm", "model": "/models/m",
                                   "modelSource": {"type": "hostPath", "hostPath": {"path": "/mnt/m"}}},
                "pools": {"canary": {"enabled": True, "engine": "kvfleet", "model": "smollm2",
                                     "modelSource": {"type": "bundled"}}}})
    assert container(engine(r, "stable"), "engine")["command"] == ["vllm", "serve"]
    assert container(engine(r, "canary"), "engine")["args"][0] == "engine"
    assert {n: p["engine"] for n, p in pools_file(r)["pools"].items()} == {"stable": "vllm", "canary": "kvfleet"}


def test_headless_services_expose_the_kv_event_ports_of_vllm_and_sglang_only():
    r = render(MIXED)
    for pool, engine_kind in (("small", "kvfleet"), ("large", "vllm"), ("medium", "sglang")):
        svc = r.one("Service", f"{SVC}-{pool}")
        assert svc["metadata"]["labels"]["kvfleet.dev/engine"] == engine_kind
        ports = {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]}
        expected = {"http": (8000, "http")}
        if engine_kind != "kvfleet":
            expected |= {"kv-events": (5557, "kv-events"), "kv-replay": (5558, "kv-replay")}
        assert ports == expected, pool


def test_pools_file_names_each_pools_model_engine_and_kv_events():
    doc = pools_file(render(MIXED))["pools"]
    k8s = {p: {"service": f"{SVC}-{p}", "namespace": NAMESPACE, "port_name": "http"} for p in doc}
    assert doc == {
        "small": {"version": "v1", "weight": 100, "model": "smollm2", "engine": "kvfleet", "k8s": k8s["small"]},
        "large": {"version": "v1", "weight": 100, "model": "llama-3.3-70b", "engine": "vllm",
                  "kv_events": "tcp://{host}:5557|tcp://{host}:5558", "tokenizer": "/models/Llama-3.3-70B-Instruct",
                  "max_context_tokens": 32768, "k8s": k8s["large"]},
        "medium": {"version": "v1", "weight": 100, "model": "qwen2.5-7b", "engine": "sglang",
                   "kv_events": "tcp://{host}:5557|tcp://{host}:5558", "max_context_tokens": 16384,
                   "k8s": k8s["medium"]},
    }


def test_the_router_parses_the_mixed_pools_file():
    """The router's own parser (router/pools/file.py) reads model, engine, kv_events and tokenizer per pool."""
    cfg = parse_pools(yaml.safe_dump(pools_file(render(MIXED))), "pools.yaml")
    got = {p.spec.name: (p.spec.models, p.engine, p.kv_events.default if p.kv_events else None, p.tokenizer)
           for p in cfg.pools}
    zmq = ("tcp://{host}:5557", "tcp://{host}:5558")
    assert got == {"small": (("smollm2",), "kvfleet", None, None),
                   "large": (("llama-3.3-70b",), "vllm", zmq, "/models/Llama-3.3-70B-Instruct"),
                   "medium": (("qwen2.5-7b",), "sglang", zmq, None)}


def _metric_names(hpa: dict) -> set[str]:
    return {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}


def test_hpa_of_each_pool_reads_its_engines_metrics():
    r = render(TOGGLES["mixed-hpa"])
    names = {p: _metric_names(r.one("HorizontalPodAutoscaler", f"{SVC}-{p}")) for p in ("small", "large", "medium")}
    vllm = {"vllm_kv_cache_usage_perc", "vllm_num_requests_waiting"}
    assert names == {"small": vllm, "large": vllm, "medium": {"sglang_token_usage", "sglang_num_queue_reqs"}}
    targets = {m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"]
               for m in r.one("HorizontalPodAutoscaler", f"{SVC}-medium")["spec"]["metrics"]}
    assert targets == {"sglang_token_usage": "800m", "sglang_num_queue_reqs": "2000m"}  # same targets, its names


def test_keda_queries_of_each_pool_read_its_engines_series():
    r = render(TOGGLES["mixed-keda"])

    def queries(pool):
        so = r.one("ScaledObject", f"{SVC}-{pool}")
        return {t["name"]: t["metadata"]["query"] for t in so["spec"]["triggers"]}

    where = '{namespace="llm",service="%s"}'
    assert queries("large") == {"kv-cache-usage": f"sum(vllm:kv_cache_usage_perc{where % f'{SVC}-large'})",
                                "waiting-requests": f"sum(vllm:num_requests_waiting{where % f'{SVC}-large'})"}
    assert queries("medium") == {"kv-cache-usage": f"sum(sglang:token_usage{where % f'{SVC}-medium'})",
                                 "waiting-requests": f"sum(sglang:num_queue_reqs{where % f'{SVC}-medium'})"}
    assert queries("small")["kv-cache-usage"].startswith("sum(vllm:kv_cache_usage_perc{")


def test_service_monitors_scrape_vllm_and_sglang_without_the_internal_token():
    r = render(TOGGLES["mixed-hpa"])
    monitors = {m["metadata"]["name"]: m for m in r.of("ServiceMonitor") if "engines" in m["metadata"]["name"]}
    prefix = f"{RELEASE}-kvfleet-engines"
    assert sorted(monitors) == [prefix, f"{prefix}-sglang", f"{prefix}-vllm"]
    for name, kind in ((prefix, "kvfleet"), (f"{prefix}-vllm", "vllm"), (f"{prefix}-sglang", "sglang")):
        sm = monitors[name]
        assert sm["spec"]["selector"]["matchLabels"]["kvfleet.dev/engine"] == kind
        (ep,) = sm["spec"]["endpoints"]
        assert ("authorization" in ep) == (kind == "kvfleet"), name
        assert {"targetLabel": "job", "replacement": "kvfleet-engine"} in ep["relabelings"]
    # a kvfleet-only release has the one engine ServiceMonitor it always had
    assert [m["metadata"]["name"] for m in render(TOGGLES["monitoring"]).of("ServiceMonitor")] == \
        [prefix, f"{RELEASE}-kvfleet-routers"]


def test_prometheus_rule_records_sglang_pools_under_the_fleets_names():
    groups = render(TOGGLES["mixed-hpa"]).one("PrometheusRule", f"{RELEASE}-kvfleet")["spec"]["groups"]
    sglang = next(g for g in groups if g["name"] == "kvfleet-sglang.rules")
    assert {r["record"]: r["expr"] for r in sglang["rules"]} == {
        "pool:vllm_kv_cache_usage_perc:avg": "avg by (pool) (sglang:token_usage)",
        "pool:vllm_kv_cache_usage_perc:max": "max by (pool) (sglang:token_usage)",
        "pool:vllm_num_requests_running:sum": "sum by (pool) (sglang:num_running_reqs)",
        "pool:vllm_num_requests_waiting:sum": "sum by (pool) (sglang:num_queue_reqs)"}
    # the alert on KV saturation reads that record, so it covers SGLang pools too
    alerts = [r for g in groups for r in g["rules"] if r.get("alert") == "KVFleetKVCacheSaturated"]
    assert "pool:vllm_kv_cache_usage_perc:avg" in alerts[0]["expr"]


def test_network_policy_lets_routers_reach_the_kv_event_ports():
    r = render(TOGGLES["mixed-hpa"])
    from_routers = r.one("NetworkPolicy", f"{RELEASE}-kvfleet-engines")["spec"]["ingress"][0]
    assert from_routers["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    assert [p["port"] for p in from_routers["ports"]] == ["http", "kv-events", "kv-replay"]
    kvfleet_only = render(TOGGLES["networkpolicy"]).one("NetworkPolicy", f"{RELEASE}-kvfleet-engines")
    assert [p["port"] for p in kvfleet_only["spec"]["ingress"][0]["ports"]] == ["http"]


def test_helm_test_and_notes_ask_for_a_model_some_pool_serves():
    r = render(MIXED)  # top-level servedModelName smollm2 is the small pool's
    pod = next(m for m in r.of("Pod") if m["metadata"]["annotations"].get("helm.sh/hook") == "test")
    assert _env(pod["spec"]["containers"][0])["MODEL"] == "smollm2"
    assert 'model "llama-3.3-70b" on vllm' in r.notes
    named = render({**MIXED, "pools": {**MIXED["pools"], "small": {"version": "v1", "weight": 0}}})
    pod = next(m for m in named.of("Pod") if m["metadata"]["annotations"].get("helm.sh/hook") == "test")
    assert _env(pod["spec"]["containers"][0])["MODEL"] == "llama-3.3-70b"  # first routable pool, by name


def test_helm_lint_strict_is_clean_for_the_mixed_fleet():
    for toggle in ("mixed-hpa", "mixed-keda"):
        for version in KUBE_VERSIONS:
            report = helm.lint(str(CHART), TOGGLES[toggle], strict=True, kube_version=f"v{version}.0")
            findings = [m for m in report["messages"] if m["severity"] >= 1 and m["error"] != "icon is recommended"]
            assert not findings and not report["errors"], (toggle, version, findings, report["errors"])


def test_the_docs_example_renders_and_validates():
    """docs/kubernetes.md's "Several models, any engine per pool" values: as written, they install."""
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    section = text[text.index("### Several models, any engine per pool"):]
    values = yaml.safe_load(section[section.index("```yaml") + 7:section.index("```", section.index("```yaml") + 7)])
    r = render(values)
    assert container(engine(r, "large"), "engine")["command"] == ["vllm", "serve"]
    assert "--tensor-parallel-size=4" in container(engine(r, "large"), "engine")["args"]
    assert {n: (p["model"], p["engine"]) for n, p in pools_file(r)["pools"].items()} == {
        "small": ("smollm2", "kvfleet"), "large": ("llama-3.3-70b", "vllm")}
    for m in r.manifests:
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(m, version, strict=True)


def _large(**over) -> dict:
    return {**MIXED, "pools": {**MIXED["pools"], "large": {**MIXED["pools"]["large"], **over}}}


@pytest.mark.parametrize("values,message", [
    (_large(gpus=0), r"pools\.large\.gpus: a vllm pool needs at least 1 GPU"),
    (_large(modelSource={"type": "bundled"}), r"pools\.large\.modelSource\.type: bundled is the model inside kvfleet"),
    (_large(extraArgs=["--max-num-seqs", "8"]), r"pools\.large\.extraArgs are `kvfleet engine` flags; give vllm's "
                                                 r"flags in pools\.large\.vllm\.extraArgs"),
    ({**MIXED, "hashSeed": 2**32}, r"hashSeed: vLLM pools \(pools\.large\) take it as PYTHONHASHSEED"),
    (_large(routerTokenizer="/data/llama"), r"pools\.large\.routerTokenizer \(/data/llama\) must be a path under "
                                            r"router\.modelSource\.mountPath \(/models\)"),
    ({**_large(), "router": {"modelSource": {"type": "bundled"}}},
     r"pools\.large\.routerTokenizer \(/models/Llama-3\.3-70B-Instruct\): routers mount no model"),
])
def test_pools_an_engine_cannot_run_are_refused_naming_the_field(values, message):
    with pytest.raises(helm.HelmError, match=message):
        render(values)


def test_an_unknown_engine_is_refused_by_the_templates_too(tmp_path):
    """With schema validation off (helm --skip-schema-validation), the templates still name the field."""
    chart = tmp_path / "kvfleet"
    shutil.copytree(CHART, chart)
    (chart / "values.schema.json").unlink()
    with pytest.raises(helm.HelmError, match=r'pools\.large\.engine: must be one of kvfleet, vllm, sglang, got '
                                             r'"tensorrt"'):
        render(_large(engine="tensorrt"), chart=chart)


@pytest.mark.parametrize("values,where,problem", [
    (_large(engine="tensorrt"), "/pools/large/engine", "value must be one of 'kvfleet', 'vllm', 'sglang'"),
    ({"engineDefaults": {"engine": "trt"}}, "/engineDefaults/engine", "value must be one of 'kvfleet'"),
    (_large(servedModelName=""), "/pools/large/servedModelName", "minLength: got 0, want 1"),
    (_large(vllm={"extraArgs": "--enforce-eager"}), "/pools/large/vllm/extraArgs", "got string, want array"),
    (_large(vllm={"prefixCachingHashAlgo": "md5"}), "/pools/large/vllm/prefixCachingHashAlgo",
     "value must be one of 'sha256'"),
    (_large(sglang={"pageSize": 0}), "/pools/large/sglang/pageSize", "minimum: got 0, want 1"),
    (_large(kvEvents={"port": 70000}), "/pools/large/kvEvents/port", "maximum: got 70,000, want 65,535"),
    (_large(shm={"sizeLimit": "lots"}), "/pools/large/shm/sizeLimit", "'lots' does not match pattern"),
    (_large(vllm={"imag": {}}), "/pools/large/vllm", "additional properties 'imag' not allowed"),
])
def test_schema_refuses_bad_engine_values_naming_the_field(values, where, problem):
    with pytest.raises(helm.HelmValuesError) as e:
        render(values)
    assert f"at '{where}': {problem}" in str(e.value)

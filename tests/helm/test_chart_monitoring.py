"""ServiceMonitors, the PrometheusRule built from files/rules/, dashboards as ConfigMaps for the Grafana sidecar,
and prometheus-adapter's rules, which rename the engines' vllm: series to the HPA's metric names."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import yaml

from tests.helm.chart import CHART, RELEASE, ROOT, TOGGLES, render

ADAPTER_RULES = CHART / "files" / "prometheus-adapter-rules.yaml"


def test_engine_service_monitor_scrapes_with_the_internal_token_and_labels_pool_and_version():
    r = render(TOGGLES["monitoring"])
    sm = r.one("ServiceMonitor", f"{RELEASE}-kvfleet-engines")
    (ep,) = sm["spec"]["endpoints"]
    assert (ep["port"], ep["path"]) == ("http", "/metrics")
    assert ep["authorization"] == {"type": "Bearer", "credentials": {"name": f"{RELEASE}-kvfleet-internal-token",
                                                                      "key": "token"}}
    assert {x["targetLabel"] for x in ep["relabelings"]} == {"pool", "version", "job"}
    assert {"targetLabel": "job", "replacement": "kvfleet-engine"} in ep["relabelings"]
    assert sm["metadata"]["labels"]["release"] == "kps"
    assert sm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "engine"
    routers = r.one("ServiceMonitor", f"{RELEASE}-kvfleet-routers")
    assert routers["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    # the job names the rules' and dashboards' selectors use
    assert routers["spec"]["endpoints"][0]["relabelings"] == [{"targetLabel": "job", "replacement": "kvfleet-router"}]
    assert not render().of("ServiceMonitor")


def test_prometheus_rule_wraps_every_rule_file_in_the_chart():
    expected = [g for p in sorted((CHART / "files" / "rules").glob("*.yaml"))
                for g in yaml.safe_load(p.read_text())["groups"]]
    rule = render(TOGGLES["monitoring"]).one("PrometheusRule", f"{RELEASE}-kvfleet")
    assert expected and rule["spec"]["groups"] == expected


def _chart_copy(tmp_path: Path) -> Path:
    dst = tmp_path / "kvfleet"
    shutil.copytree(CHART, dst)
    return dst


def test_dashboards_become_labelled_configmaps(tmp_path):
    chart = _chart_copy(tmp_path)
    for p in (chart / "files" / "dashboards").glob("*.json"):
        p.unlink()  # just these two
    (chart / "files" / "dashboards" / "kvfleet_fleet.json").write_text('{"title": "kvfleet fleet", "panels": []}')
    (chart / "files" / "dashboards" / "replica.json").write_text('{"title": "replica"}')
    r = render({"monitoring": {"dashboards": {"enabled": True, "namespace": "grafana"}}}, chart=chart)
    cms = {m["metadata"]["name"]: m for m in r.of("ConfigMap") if "dashboard" in m["metadata"]["name"]}
    assert sorted(cms) == [f"{RELEASE}-kvfleet-dashboard-kvfleet-fleet", f"{RELEASE}-kvfleet-dashboard-replica"]
    fleet = cms[f"{RELEASE}-kvfleet-dashboard-kvfleet-fleet"]
    assert fleet["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert fleet["metadata"]["namespace"] == "grafana"
    assert fleet["data"] == {"kvfleet_fleet.json": '{"title": "kvfleet fleet", "panels": []}'}


def test_rule_groups_of_several_files_are_concatenated(tmp_path):
    chart = _chart_copy(tmp_path)
    (chart / "files" / "rules" / "zz-alerts.rules.yaml").write_text(
        "groups:\n- name: extra\n  rules:\n  - alert: X\n    expr: vector(1) > 0\n")
    rule = render(TOGGLES["monitoring"], chart=chart).one("PrometheusRule", f"{RELEASE}-kvfleet")
    assert [g["name"] for g in rule["spec"]["groups"]][-1] == "extra"


def _go_replacement(template: str, match: re.Match) -> str:
    """Go's regexp Expand for the `${1}` form prometheus-adapter's `as` uses."""
    return re.sub(r"\$\{(\d+)\}", lambda m: match.group(int(m.group(1))), template)


def test_adapter_rules_rename_the_engine_series_to_the_hpa_metric_names():
    rules = yaml.safe_load(ADAPTER_RULES.read_text())["rules"]
    # the HPAs of a fleet with every engine (kvfleet, vLLM, SGLang) name every metric the adapter serves
    wanted = {m["pods"]["metric"]["name"] for hpa in render(TOGGLES["mixed-hpa"]).of("HorizontalPodAutoscaler")
              for m in hpa["spec"]["metrics"]}
    served = set()
    for rule in rules:
        series = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["seriesQuery"]).group(0)
        m = re.search(rule["name"]["matches"], series)
        assert m, (series, rule["name"])
        name = _go_replacement(rule["name"]["as"], m)
        assert re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", name), name  # no ':' in custom metrics API names
        served.add(name)
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"},
                                                  "pod": {"resource": "pod"}}
        assert "<<.LabelMatchers>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]
    assert served == wanted


def test_adapter_and_keda_read_series_the_engines_export():
    source = (ROOT / "engine" / "server" / "metrics.py").read_text()
    rules = yaml.safe_load(ADAPTER_RULES.read_text())["rules"]
    series = {re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", r["seriesQuery"]).group(0) for r in rules}
    for so in render(TOGGLES["mixed-keda"]).of("ScaledObject"):
        series |= {re.match(r"sum\(([a-zA-Z_:][a-zA-Z0-9_:]*)\{", t["metadata"]["query"]).group(1)
                   for t in so["spec"]["triggers"]}
    # SGLang's own names (its scheduler's gauges); kvfleet's engine exports vLLM's, which vLLM pools share
    assert series == {"vllm:kv_cache_usage_perc", "vllm:num_requests_waiting",
                      "sglang:token_usage", "sglang:num_queue_reqs"}
    for name in sorted(series - {"sglang:token_usage", "sglang:num_queue_reqs"}):
        assert f'"{name}"' in source, f"{name} is not an engine metric (engine/server/metrics.py)"


def test_adapter_rules_configmap_carries_the_file():
    r = render(TOGGLES["hpa"])
    cm = r.one("ConfigMap", f"{RELEASE}-kvfleet-prometheus-adapter")
    assert yaml.safe_load(cm["data"]["config.yaml"]) == yaml.safe_load(ADAPTER_RULES.read_text())

"""The committed dashboard JSON is what the generator writes, and covers the monitoring list."""

from __future__ import annotations

import json

import pytest

from dashboards import GRAFANA_DIR
from dashboards.build import DASHBOARDS, generate, main
from dashboards.expressions import panels

# the seeds' "monitor at a minimum" list (+ KV usage), and the panel that shows each, on both dashboards
MONITORING = {
    "GPU memory utilization": "GPU memory used (CPU: resident memory)",
    "KV usage": "KV cache usage",
    "Active sequences": "Active and waiting sequences",
    "Waiting queue length": "Active and waiting sequences",
    "Prefill tokens/s": "Prefill and decode tokens/s",
    "Decode tokens/s": "Prefill and decode tokens/s",
    "TTFT p50 / p95 / p99": "TTFT p50 / p95 / p99",
    "TPOT p50 / p95 / p99": "TPOT p50 / p95 / p99",
    "Cache hit ratio": "Cache hit ratio",
    "Block allocation failure": "Block allocation failures and evictions/s",
    "Eviction count": "Block allocation failures and evictions/s",
    "OOM count": "OOM count",
    "Request cancellation rate": "Request cancellation rate",
}
FLEET_ONLY = ["Preemptions/s", "Errors by type", "Routing decisions by reason", "Predicted vs reported cached tokens/s",
              "Rate-limit rejections per tenant", "Replicas: desired vs running", "TTFT p99 per pool",
              "Error ratio per pool", "Degradation level"]


def test_committed_json_is_what_the_generator_writes():
    for name, text in generate().items():
        assert (GRAFANA_DIR / name).read_text() == text, f"{name} is stale: run python -m dashboards.build"
    assert sorted(p.name for p in GRAFANA_DIR.glob("*.json")) == sorted(DASHBOARDS)


def test_check_mode_reports_a_stale_file(tmp_path, capsys):
    assert main(["--out", str(tmp_path)]) == 0
    assert main(["--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "kvfleet-fleet.json").write_text("{}")
    assert main(["--out", str(tmp_path), "--check"]) == 1
    assert "kvfleet-fleet.json" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_every_monitoring_item_has_its_panel(name):
    titles = {p["title"] for p in panels(GRAFANA_DIR / name)}
    missing = {item: t for item, t in MONITORING.items() if t not in titles}
    assert not missing
    if name == "kvfleet-fleet.json":
        assert not [t for t in FLEET_ONLY if t not in titles]


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_dashboard_shape(name):
    board = json.loads((GRAFANA_DIR / name).read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in board["templating"]["list"]} >= {"datasource"}
    for p in panels(GRAFANA_DIR / name):
        assert p["type"] == "timeseries" and p["datasource"]["uid"] == "${datasource}" and p["description"]
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs))
        for t in p["targets"]:
            assert t["expr"] == " ".join(t["expr"].split()) and t["legendFormat"]

"""kvfleet's Grafana dashboards (generated from code by `python -m dashboards.build` into `grafana/`) and
Prometheus rules (`prometheus/kvfleet-rules.yaml`), and a PNG renderer of the dashboards' panels."""

from pathlib import Path

HERE = Path(__file__).resolve().parent
GRAFANA_DIR = HERE / "grafana"
RULES_FILE = HERE / "prometheus" / "kvfleet-rules.yaml"
ENGINE_JOB = "kvfleet-engine"  # scrape job names the rules and dashboards select on
ROUTER_JOB = "kvfleet-router"

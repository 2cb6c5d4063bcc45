"""Every PromQL expression kvfleet ships - dashboard panel queries and rules - ready to send to a Prometheus.

Dashboard queries carry Grafana variables; `substitute` gives them concrete values (`$__rate_interval` a
window, any other variable its All value `.*`). An alert's expression holds only while it fires, so
`alert_operands` gives what it compares, which must have data whenever the fleet is scraped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from dashboards import GRAFANA_DIR, RULES_FILE

_VARIABLE = re.compile(r"\$\{([A-Za-z_]\w*)(?::\w+)?\}|\$([A-Za-z_]\w*)")
_COMPARISON = re.compile(r"\s*(>=|<=|==|!=|>|<)\s*[0-9.eE+-]+\s*$")


@dataclass(frozen=True)
class Expression:
    source: str   # where it is: "kvfleet-fleet.json: KV cache usage [A]", "record pool:...", "alert KVFleet..."
    expr: str
    kind: str     # panel | record | alert


def substitute(expr: str, rate_interval: str = "1m", values: dict[str, str] | None = None) -> str:
    """Grafana variables replaced: $__rate_interval by rate_interval, others by values[name] or `.*` (All)."""
    values = values or {}

    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name == "__rate_interval":
            return rate_interval
        return values.get(name, ".*")

    return _VARIABLE.sub(one, expr)


def panels(path: Path) -> list[dict]:
    """The dashboard's time-series panels (rows left out), in order."""
    return [p for p in json.loads(path.read_text())["panels"] if p.get("type") != "row"]


def dashboard_expressions(directory: Path = GRAFANA_DIR) -> list[Expression]:
    out = []
    for path in sorted(directory.glob("*.json")):
        for p in panels(path):
            for t in p.get("targets", []):
                out.append(Expression(f"{path.name}: {p['title']} [{t['refId']}]", t["expr"], "panel"))
    return out


def rule_expressions(path: Path = RULES_FILE) -> list[Expression]:
    out = []
    for group in yaml.safe_load(path.read_text())["groups"]:
        for r in group["rules"]:
            if "record" in r:
                labels = "".join(f" {k}={v}" for k, v in sorted(r.get("labels", {}).items()))
                out.append(Expression(f"record {r['record']}{labels}", " ".join(r["expr"].split()), "record"))
            else:
                out.append(Expression(f"alert {r['alert']}", " ".join(r["expr"].split()), "alert"))
    return out


def all_expressions() -> list[Expression]:
    return dashboard_expressions() + rule_expressions()


def alert_operands(expr: str) -> list[str]:
    """The series an alert compares: each `and` operand without its trailing comparison with a number."""
    return [_COMPARISON.sub("", part).strip() for part in re.split(r"\s+and\s+", expr)]

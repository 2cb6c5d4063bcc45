"""Building blocks of kvfleet's dashboards on grafana-foundation-sdk: a query, a time-series panel, a board
that lays panels out in rows and numbers them, and the template variables."""

from __future__ import annotations

import json
from dataclasses import dataclass

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import prometheus as prom_b
from grafana_foundation_sdk.builders import timeseries as ts_b
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_m
from grafana_foundation_sdk.models import dashboard as dash_m

DATASOURCE = dash_m.DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"  # Grafana's rate window: at least 4 scrape intervals


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"    # Grafana unit id: short, percentunit, s, bytes, reqps, ...
    min: float | None = None
    max: float | None = None
    width: int = 8         # of 24 grid columns

    def __post_init__(self):
        if not self.queries:
            raise ValueError(f"Panel {self.title!r}: queries: at least one")
        if not 1 <= self.width <= 24:
            raise ValueError(f"Panel {self.title!r}: width: must be in 1..24, got {self.width}")


def q(expr: str, legend: str) -> Query:
    return Query(" ".join(expr.split()), legend)  # one line, single spaces: what Grafana and the tests see


def _timeseries(p: Panel, panel_id: int) -> ts_b.Panel:
    b = (ts_b.Panel().id(panel_id).title(p.title).description(p.description).datasource(DATASOURCE)
         .unit(p.unit).span(p.width).height(8).line_width(1).fill_opacity(10)
         .legend(common_b.VizLegendOptions().show_legend(True).display_mode(common_m.LegendDisplayMode.LIST)
                 .placement(common_m.LegendPlacement.BOTTOM))
         .tooltip(common_b.VizTooltipOptions().mode(common_m.TooltipDisplayMode.MULTI)
                  .sort(common_m.SortOrder.DESCENDING)))
    if p.min is not None:
        b = b.min(p.min)
    if p.max is not None:
        b = b.max(p.max)
    for i, query in enumerate(p.queries):
        b = b.with_target(prom_b.Dataquery().ref_id(chr(ord("A") + i)).expr(query.expr)
                          .legend_format(query.legend).datasource(DATASOURCE).range())
    return b


def datasource_variable() -> dash_b.DatasourceVariable:
    return dash_b.DatasourceVariable("datasource").label("Data source").type("prometheus")


def label_variable(name: str, label: str, metric: str) -> dash_b.QueryVariable:
    """A multi-value variable over a label's values; All matches every value, and series without the label."""
    return (dash_b.QueryVariable(name).label(label).datasource(DATASOURCE)
            .query({"query": f"label_values({metric}, {name})", "refId": f"{name}-values"})
            .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dash_m.VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".*"))


def board(uid: str, title: str, description: str, variables: list, rows: list[tuple[str, list[Panel]]]):
    """A dashboard of rows of panels, numbered in order."""
    d = (dash_b.Dashboard(title).uid(uid).description(description).tags(["kvfleet"]).editable()
         .tooltip(dash_m.DashboardCursorSync.CROSSHAIR).time("now-1h", "now").refresh("30s").timezone("browser"))
    for v in variables:
        d = d.with_variable(v)
    panel_id = 0
    for row_title, panels in rows:
        panel_id += 1
        d = d.with_row(dash_b.Row(row_title).id(panel_id))
        for p in panels:
            panel_id += 1
            d = d.with_panel(_timeseries(p, panel_id))
    return d


def to_json(dashboard_builder) -> str:
    """The dashboard as Grafana imports it: stable key order, two-space indent, a final newline."""
    return json.dumps(dashboard_builder.build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"

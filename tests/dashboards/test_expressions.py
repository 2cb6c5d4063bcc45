"""The pure parts of the expression list and the renderer: variable substitution, alert operands, legends,
units, the time axis."""

from __future__ import annotations

import math

from dashboards.expressions import alert_operands, all_expressions, rule_expressions, substitute
from dashboards.render import clock, format_value, legend


def test_substitute_grafana_variables():
    expr = 'sum by (instance) (rate(x{instance=~"$instance",pool=~"${pool}"}[$__rate_interval]))'
    assert substitute(expr) == 'sum by (instance) (rate(x{instance=~".*",pool=~".*"}[1m]))'
    assert substitute(expr, "30s", {"instance": "127.0.0.1:8001"}) == \
        'sum by (instance) (rate(x{instance=~"127.0.0.1:8001",pool=~".*"}[30s]))'
    assert substitute('label_replace(x, "a", "$1", "b", "(.*)")') == 'label_replace(x, "a", "$1", "b", "(.*)")'


def test_alert_operands_drop_the_comparison():
    assert alert_operands("pool:x:avg > 0.9") == ["pool:x:avg"]
    assert alert_operands('up{job=~"a|b"} == 0') == ['up{job=~"a|b"}']
    assert alert_operands("abs(a - b) > 0.1 and c > 10") == ["abs(a - b)", "c"]
    assert alert_operands("max by (pool) (lvl) >= 3") == ["max by (pool) (lvl)"]


def test_every_expression_is_listed_once_per_place():
    exprs = all_expressions()
    kinds = {e.kind for e in exprs}
    assert kinds == {"panel", "record", "alert"}
    assert len({e.source for e in exprs}) == len(exprs)
    rules = rule_expressions()
    assert sum(e.kind == "alert" for e in rules) == 12 and sum(e.kind == "record" for e in rules) == 22


def test_legend_format():
    assert legend("p99 {{instance}}", {"instance": "a:1"}) == "p99 a:1"
    assert legend("{{pool}} {{version}}", {"pool": "canary"}) == "canary"
    assert legend("", {"b": "2", "a": "1"}) == '{a="1", b="2"}'


def test_format_value_per_unit():
    assert format_value(0.25, "percentunit") == "25%"
    assert format_value(3 * 1024 ** 3, "bytes") == "3 GiB"
    assert format_value(0.0123, "s") == "12.3 ms" and format_value(2.5, "s") == "2.5 s"
    assert format_value(1500, "short") == "1.5k" and format_value(2.0, "reqps") == "2 req/s"
    assert format_value(math.nan, "short") == ""


def test_clock():
    assert [clock(x) for x in (0, -0.2, -90, -3600 - 61)] == ["now", "now", "-1:30", "-1:01:01"]

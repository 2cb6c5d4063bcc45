"""The chart's copies of dashboards/ and its rule files are current (deploy/chart_files.py), and the sync itself
copies, updates and deletes as it says."""

from __future__ import annotations

from deploy import chart_files


def test_chart_copies_of_dashboards_and_rules_are_current():
    stale = chart_files.differences()
    assert not stale, "run `python -m deploy.chart_files`:\n" + "\n".join(stale)


def test_sync_copies_updates_and_removes(tmp_path):
    root, files = tmp_path, tmp_path / "chart-files"
    (root / "dashboards" / "prometheus").mkdir(parents=True)
    (root / "dashboards" / "grafana").mkdir(parents=True)
    (files / "rules").mkdir(parents=True)
    (files / "rules" / "placeholder-rules.yaml").write_text("placeholder")
    # no sources yet: nothing to do, the placeholder stays
    assert chart_files.differences(root, files) == [] and chart_files.sync(root, files) == []
    (root / "dashboards" / "grafana" / "fleet.json").write_text("{}")
    (root / "dashboards" / "prometheus" / "alerts-rules.yaml").write_text("groups: []")
    assert chart_files.differences(root, files) == [
        "chart-files/dashboards/fleet.json: missing (copy of dashboards/grafana/fleet.json)",
        "chart-files/rules/alerts-rules.yaml: missing (copy of dashboards/prometheus/alerts-rules.yaml)",
        "chart-files/rules/placeholder-rules.yaml: its source is gone"]
    chart_files.sync(root, files)
    assert (files / "dashboards" / "fleet.json").read_text() == "{}"
    assert sorted(p.name for p in (files / "rules").iterdir()) == ["alerts-rules.yaml"]
    assert chart_files.differences(root, files) == []
    (root / "dashboards" / "grafana" / "fleet.json").write_text('{"v": 2}')
    assert chart_files.differences(root, files) == ["chart-files/dashboards/fleet.json: differs from "
                                                    "dashboards/grafana/fleet.json"]
    assert chart_files.main(["--check"]) in (0, 1)  # the real repository: exercised above

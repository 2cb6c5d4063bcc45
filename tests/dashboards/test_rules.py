"""promtool checks the rule file and runs its unit tests (tests/dashboards/rules_test.yaml), which must cover
every recording rule and alert."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from dashboards import RULES_FILE
from deploy.prometheus import require_binaries

HERE = Path(__file__).parent
UNIT_TESTS = HERE / "rules_test.yaml"
BIN = require_binaries()  # `make test` unpacks Debian's prometheus package; without it these tests fail loudly


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES_FILE.read_text())["groups"] for r in g["rules"]]


def test_promtool_check_rules():
    out = subprocess.run([BIN.promtool, "check", "rules", str(RULES_FILE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules())} rules found" in out.stdout


def test_promtool_unit_tests_pass():
    out = subprocess.run([BIN.promtool, "test", "rules", str(UNIT_TESTS)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_promtool_unit_tests_catch_a_changed_threshold(tmp_path):
    """The unit tests bite: a saturation threshold of 0.96 instead of 0.9 fails them."""
    changed = tmp_path / "kvfleet-rules.yaml"
    changed.write_text(RULES_FILE.read_text().replace("pool:vllm_kv_cache_usage_perc:avg > 0.9",
                                                      "pool:vllm_kv_cache_usage_perc:avg > 0.96"))
    tests = tmp_path / "rules_test.yaml"
    tests.write_text(UNIT_TESTS.read_text().replace("../../dashboards/prometheus/kvfleet-rules.yaml", str(changed)))
    out = subprocess.run([BIN.promtool, "test", "rules", str(tests)], capture_output=True, text=True)
    assert out.returncode == 1 and "KVFleetKVCacheSaturated" in out.stdout + out.stderr


def test_unit_tests_cover_every_recording_rule_and_alert():
    tests = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    tested_alerts = {a["alertname"] for t in tests for a in t.get("alert_rule_test", [])
                     if a.get("exp_alerts")}
    tested_exprs = " ".join(e["expr"] for t in tests for e in t.get("promql_expr_test", []))
    records = {r["record"] for r in rules() if "record" in r}
    alerts = {r["alert"] for r in rules() if "alert" in r}
    assert alerts <= tested_alerts, alerts - tested_alerts
    assert {r for r in records if not re.search(re.escape(r) + r"\b", tested_exprs)} == set()


def test_alerts_have_severity_summary_and_description():
    for r in rules():
        if "alert" in r:
            assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
            assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]

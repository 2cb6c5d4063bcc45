"""deploy/prometheus.py: finding the binaries, and the configuration it writes (loaded by the real promtool)."""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml

from dashboards import RULES_FILE
from deploy.prometheus import find_binaries, prometheus_argv, require_binaries, scrape_config


def test_scrape_config_names_the_jobs_the_rules_select_on():
    cfg = scrape_config(["http://127.0.0.1:8001", "127.0.0.1:8002"], ["http://127.0.0.1:8000/"], interval_s=2)
    assert cfg["global"] == {"scrape_interval": "2s", "evaluation_interval": "2s", "scrape_timeout": "2s"}
    assert cfg["rule_files"] == [str(RULES_FILE)]
    engines, routers = cfg["scrape_configs"]
    assert engines == {"job_name": "kvfleet-engine", "static_configs": [
        {"targets": ["127.0.0.1:8001", "127.0.0.1:8002"], "labels": {"pool": "default"}}]}
    assert routers == {"job_name": "kvfleet-router", "static_configs": [{"targets": ["127.0.0.1:8000"]}]}
    with pytest.raises(ValueError, match="interval_s"):
        scrape_config([], [], interval_s=0)


def test_find_binaries_honours_the_override_dir(tmp_path, monkeypatch):
    for name in ("prometheus", "promtool"):
        (tmp_path / name).write_text("#!/bin/sh\n")
        os.chmod(tmp_path / name, 0o755)
    monkeypatch.setenv("KVFLEET_PROMETHEUS_DIR", str(tmp_path))
    b = find_binaries()
    assert (b.prometheus, b.promtool) == (str(tmp_path / "prometheus"), str(tmp_path / "promtool"))
    argv = prometheus_argv(b, "p.yml", "data", "127.0.0.1", 9999)
    assert argv[1:4] == ["--config.file=p.yml", "--storage.tsdb.path=data", "--web.listen-address=127.0.0.1:9999"]


def test_promtool_accepts_the_config(tmp_path):
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(scrape_config(["127.0.0.1:8001"], ["127.0.0.1:8000"])))
    out = subprocess.run([require_binaries().promtool, "check", "config", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr

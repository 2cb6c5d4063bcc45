"""A real Prometheus for the local fleet and for tests: finding the binaries, its configuration, its command line.

The binaries are Debian's `prometheus` package, looked for in $KVFLEET_PROMETHEUS_DIR, then on PATH, then
unpacked under `<venv>/prometheus/usr/bin/` (`make prometheus` puts them there with `apt-get download` +
`dpkg -x`: nothing installed system-wide).

    b = find_binaries()                      # None when neither place has them
    cfg = scrape_config(["127.0.0.1:8001"], ["127.0.0.1:8000"], interval_s=5)
    argv = prometheus_argv(b, "prometheus.yml", "data/", "127.0.0.1", 9090)
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from dashboards import ENGINE_JOB, ROUTER_JOB, RULES_FILE

INSTALL_HINT = ("no prometheus/promtool: run `make prometheus` (Debian's package unpacked into .venv/prometheus), "
                "`apt-get install prometheus`, or put both binaries on PATH")


@dataclass(frozen=True)
class Binaries:
    prometheus: str
    promtool: str


def _search_path() -> list[Path | None]:
    """Where to look, in order; None stands for PATH."""
    root = Path(__file__).resolve().parents[1]
    extra = os.environ.get("KVFLEET_PROMETHEUS_DIR")
    return [*([Path(extra)] if extra else []), None, Path(sys.prefix) / "prometheus" / "usr" / "bin",
            root / ".venv" / "prometheus" / "usr" / "bin"]


def _executable(path: Path) -> str | None:
    return str(path) if os.access(path, os.X_OK) else None


def find_binaries() -> Binaries | None:
    """KVFLEET_PROMETHEUS_DIR, then PATH, then the venv's unpacked Debian package."""
    for d in _search_path():
        if d is None:
            p, t = shutil.which("prometheus"), shutil.which("promtool")
        else:
            p, t = _executable(d / "prometheus"), _executable(d / "promtool")
        if p and t:
            return Binaries(p, t)
    return None


def require_binaries() -> Binaries:
    b = find_binaries()
    if b is None:
        raise RuntimeError(INSTALL_HINT)
    return b


def _target(url_or_hostport: str) -> str:
    return url_or_hostport.split("://", 1)[-1].rstrip("/")


def scrape_config(engines: list[str], routers: list[str], interval_s: float = 5.0,
                  rule_files: tuple[str, ...] = (str(RULES_FILE),), engine_labels: dict | None = None) -> dict:
    """Prometheus configuration scraping engines and routers (URLs or host:port) under kvfleet's job names."""
    if interval_s <= 0:
        raise ValueError(f"interval_s: must be > 0, got {interval_s}")
    interval = f"{interval_s:g}s"
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval, "scrape_timeout": interval},
        "rule_files": list(rule_files),
        "scrape_configs": [
            {"job_name": ENGINE_JOB, "static_configs": [
                {"targets": [_target(e) for e in engines], "labels": dict(engine_labels or {"pool": "default"})}]},
            {"job_name": ROUTER_JOB, "static_configs": [{"targets": [_target(r) for r in routers]}]},
        ],
    }


def prometheus_argv(b: Binaries, config_path: str, data_dir: str, host: str, port: int) -> list[str]:
    return [b.prometheus, f"--config.file={config_path}", f"--storage.tsdb.path={data_dir}",
            f"--web.listen-address={host}:{port}", "--storage.tsdb.retention.time=1d", "--log.level=warn"]

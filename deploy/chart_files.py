"""Copy the dashboards and Prometheus rule files into the Helm chart, or check that the chart's copies are current.

Helm's `.Files` sees only files inside the chart, so the chart carries copies of what `dashboards/` holds
(the source of truth): `helm/kvfleet/files/dashboards/*.json` become ConfigMaps for the Grafana sidecar,
`helm/kvfleet/files/rules/*.yaml` the PrometheusRule.

    python -m deploy.chart_files          # copy (and delete chart copies whose source is gone)
    python -m deploy.chart_files --check  # exit 1 and name the stale files; tests/helm runs this check

The sources: `dashboards/grafana/*.json` and `dashboards/prometheus/*-rules.yaml`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHART_FILES = ROOT / "helm" / "kvfleet" / "files"


@dataclass(frozen=True)
class Mapping:
    """Files matching `pattern` under `source` (relative to the repository) are copied, flat, into `target`
    (relative to the chart's files/ directory)."""

    source: str
    pattern: str
    target: str


MAPPINGS = (
    Mapping("dashboards/grafana", "*.json", "dashboards"),
    Mapping("dashboards/prometheus", "*-rules.yaml", "rules"),
)


def plan(root: Path = ROOT, chart_files: Path = CHART_FILES) -> tuple[dict[Path, Path], list[Path]]:
    """(chart copy -> its source) for every source file, and the chart copies to delete (source gone).
    A mapping whose source directory holds no matching file is left alone (the chart's placeholder stays)."""
    copies: dict[Path, Path] = {}
    stale: list[Path] = []
    for m in MAPPINGS:
        sources = sorted((root / m.source).glob(m.pattern))
        if not sources:
            continue
        target = chart_files / m.target
        names = {s.name for s in sources}
        copies.update({target / s.name: s for s in sources})
        stale += [t for t in sorted(target.glob(m.pattern)) if t.name not in names]
    return copies, stale


def differences(root: Path = ROOT, chart_files: Path = CHART_FILES) -> list[str]:
    """What a sync would change, one line each; empty when the chart is current."""
    copies, stale = plan(root, chart_files)
    out = [f"{dst.relative_to(root)}: differs from {src.relative_to(root)}" if dst.exists()
           else f"{dst.relative_to(root)}: missing (copy of {src.relative_to(root)})"
           for dst, src in copies.items() if not dst.exists() or dst.read_bytes() != src.read_bytes()]
    return out + [f"{p.relative_to(root)}: its source is gone" for p in stale]


def sync(root: Path = ROOT, chart_files: Path = CHART_FILES) -> list[str]:
    changed = differences(root, chart_files)
    copies, stale = plan(root, chart_files)
    for dst, src in copies.items():
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
    for p in stale:
        p.unlink()
    return changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.chart_files", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if the chart's copies are stale")
    ns = p.parse_args(argv)
    lines = differences() if ns.check else sync()
    for line in lines:
        print(line)
    if ns.check and lines:
        print("run: python -m deploy.chart_files", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

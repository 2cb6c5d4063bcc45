"""Writes the Grafana dashboards as JSON (committed under dashboards/grafana/), or checks that they are current.

    python -m dashboards.build            # regenerate dashboards/grafana/*.json
    python -m dashboards.build --check    # exit 1 if a committed file differs from what the code generates
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dashboards import GRAFANA_DIR
from dashboards.fleet import fleet_dashboard
from dashboards.panels import to_json
from dashboards.replica import replica_dashboard

DASHBOARDS = {"kvfleet-fleet.json": fleet_dashboard, "kvfleet-replica.json": replica_dashboard}


def generate() -> dict[str, str]:
    """File name -> JSON text, for every dashboard."""
    return {name: to_json(make()) for name, make in DASHBOARDS.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dashboards.build", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=GRAFANA_DIR, help="directory for the JSON files")
    p.add_argument("--check", action="store_true", help="only compare with the files there")
    ns = p.parse_args(argv)
    stale = []
    for name, text in generate().items():
        path = ns.out / name
        if ns.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
            continue
        ns.out.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    if stale:
        print("out of date (run python -m dashboards.build): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

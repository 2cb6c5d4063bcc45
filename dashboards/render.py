"""Renders the dashboards' panels from a Prometheus to PNG, for a user without Grafana.

    python -m dashboards.render --prometheus http://127.0.0.1:9090 --out dashboards-png [--minutes 30]

For each dashboard JSON under dashboards/grafana/ it writes OUT/<file name>/NN-<title>.png per panel (the same
queries, legends, units and axis limits as in Grafana, over the last --minutes), and one page with all
panels on one page (OUT/<file name>.png). Variables take their All value unless given (`--var instance=127.0.0.1:8001`).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dashboards import GRAFANA_DIR
from dashboards.expressions import panels, substitute
from dashboards.promapi import PrometheusAPI, PromQLError

_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")
_BINARY = ("B", "KiB", "MiB", "GiB", "TiB")


@dataclass(frozen=True)
class Line:
    label: str
    times: tuple[float, ...]
    values: tuple[float, ...]


@dataclass(frozen=True)
class RenderedPanel:
    title: str
    path: Path
    lines: int
    errors: tuple[str, ...]


def legend(fmt: str, labels: dict[str, str]) -> str:
    """Grafana's legendFormat: {{label}} replaced by the series' value of it ('' if absent)."""
    text = _LEGEND.sub(lambda m: labels.get(m.group(1), ""), fmt or "").strip()
    return " ".join(text.split()) or "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def format_value(value: float, unit: str) -> str:
    """A y-axis tick in the panel's Grafana unit (short, percentunit, s, bytes, reqps)."""
    if math.isnan(value):
        return ""
    if unit == "percentunit":
        return f"{value * 100:.3g}%"
    if unit == "bytes":
        i = 0
        while abs(value) >= 1024 and i < len(_BINARY) - 1:
            value, i = value / 1024, i + 1
        return f"{value:.3g} {_BINARY[i]}"
    if unit == "s":
        if value != 0 and abs(value) < 1:
            return f"{value * 1000:.3g} ms"
        return f"{value:.3g} s"
    suffix = " req/s" if unit == "reqps" else ""
    for scale, letter in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{letter}{suffix}"
    return f"{value:.3g}{suffix}"


def clock(offset_s: float) -> str:
    """An x-axis tick: seconds before now as -m:ss (-h:mm:ss past an hour), 'now' at 0."""
    if round(offset_s) == 0:
        return "now"
    t = round(abs(offset_s))
    h, m, s = t // 3600, t // 60 % 60, t % 60
    return f"-{h}:{m:02d}:{s:02d}" if h else f"-{m}:{s:02d}"


def fetch_lines(api: PrometheusAPI, panel: dict, start: float, end: float, step: float, rate_interval: str,
                values: dict[str, str]) -> tuple[list[Line], list[str]]:
    lines, errors = [], []
    for t in panel.get("targets", []):
        expr = substitute(t["expr"], rate_interval, values)
        try:
            result = api.query_range(expr, start, end, step)
        except PromQLError as e:
            errors.append(f"[{t['refId']}] {e}")
            continue
        for series in result:
            pts = [(float(ts), float(v)) for ts, v in series["values"]]
            lines.append(Line(legend(t.get("legendFormat", ""), series["metric"]), tuple(p[0] for p in pts),
                              tuple(p[1] for p in pts)))
    return lines, errors


def draw(ax, panel: dict, lines: list[Line], errors: list[str], start: float, end: float) -> None:
    from matplotlib.ticker import FuncFormatter

    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    unit = defaults.get("unit", "short")
    ax.set_title(panel["title"], fontsize=10, loc="left")
    for line in lines:
        ax.plot([t - end for t in line.times], line.values, linewidth=1.2, label=line.label)
    ax.set_xlim(start - end, 0)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: clock(x)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: format_value(y, unit)))
    if defaults.get("min") is not None:
        ax.set_ylim(bottom=defaults["min"])
    if defaults.get("max") is not None:
        ax.set_ylim(top=defaults["max"])
    ax.grid(True, alpha=0.3)
    ax.tick_params(labelsize=8)
    if lines:
        ax.legend(fontsize=7, loc="upper left", ncol=2 if len(lines) > 4 else 1, framealpha=0.6)
    else:
        ax.text(0.5, 0.5, "No data" if not errors else "Query error:\n" + "\n".join(errors)[:300],
                ha="center", va="center", transform=ax.transAxes, fontsize=9, color="gray", wrap=True)


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def render_dashboard(api: PrometheusAPI, path: Path, out: Path, minutes: float, step: float | None = None,
                     rate_interval: str = "1m", values: dict[str, str] | None = None,
                     now: float | None = None) -> list[RenderedPanel]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = now if now is not None else time.time()
    start = end - minutes * 60
    step = step or max(1.0, round(minutes * 60 / 300))
    board = json.loads(path.read_text())
    (out / path.stem).mkdir(parents=True, exist_ok=True)
    ps = panels(path)
    cols = 3
    rows = math.ceil(len(ps) / cols)
    page, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.4 * rows), squeeze=False)
    rendered = []
    for i, p in enumerate(ps):
        lines, errors = fetch_lines(api, p, start, end, step, rate_interval, values or {})
        fig, ax = plt.subplots(figsize=(8, 3.6))
        draw(ax, p, lines, errors, start, end)
        # fixed margins (in inches: 0.85 left for tick labels such as "1.23 GiB", 0.45 above for the title):
        # tight_layout measured every tick label's extent and took a third of the rendering time
        fig.subplots_adjust(left=0.85 / 8, right=1 - 0.15 / 8, bottom=0.4 / 3.6, top=1 - 0.45 / 3.6)
        file = out / path.stem / f"{i + 1:02d}-{_slug(p['title'])}.png"
        fig.savefig(file, dpi=90)
        plt.close(fig)
        draw(axes[i // cols][i % cols], p, lines, errors, start, end)
        rendered.append(RenderedPanel(p["title"], file, len(lines), tuple(errors)))
    for j in range(len(ps), rows * cols):
        axes[j // cols][j % cols].axis("off")
    page.suptitle(board.get("title", path.stem), fontsize=14)
    page.tight_layout(rect=(0, 0, 1, 1 - 0.5 / (3.4 * rows)))
    page.savefig(out / f"{path.stem}.png", dpi=70)
    plt.close(page)
    return rendered


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dashboards.render", description=__doc__.splitlines()[0])
    p.add_argument("--prometheus", required=True, help="Prometheus URL, e.g. the one `kvfleet up --prometheus` prints")
    p.add_argument("--out", type=Path, required=True, help="directory for the PNG files")
    p.add_argument("--minutes", type=float, default=30.0, help="time range, ending now (default 30)")
    p.add_argument("--step", type=float, default=None, help="query resolution in seconds (default: range/300)")
    p.add_argument("--rate-interval", default="1m", help="what $__rate_interval stands for (default 1m)")
    p.add_argument("--var", action="append", default=[], metavar="NAME=VALUE",
                   help="a dashboard variable's value (default: All)")
    p.add_argument("--dashboards", type=Path, default=GRAFANA_DIR, help="directory of dashboard JSON files")
    ns = p.parse_args(argv)
    if ns.minutes <= 0:
        p.error("--minutes must be > 0")
    values = {}
    for item in ns.var:
        name, sep, value = item.partition("=")
        if not sep or not name:
            p.error(f"--var {item!r}: expected NAME=VALUE")
        values[name] = value
    files = sorted(ns.dashboards.glob("*.json"))
    if not files:
        p.error(f"--dashboards {ns.dashboards}: no JSON files")
    with PrometheusAPI(ns.prometheus) as api:
        if not api.ready():
            print(f"no Prometheus answering at {ns.prometheus}", file=sys.stderr)
            return 1
        for path in files:
            done = render_dashboard(api, path, ns.out, ns.minutes, ns.step, ns.rate_interval, values)
            with_data = sum(1 for r in done if r.lines)
            print(f"{path.name}: {len(done)} panels ({with_data} with data) -> {ns.out / path.stem}/", flush=True)
            for r in done:
                for e in r.errors:
                    print(f"  {r.title}: {e}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

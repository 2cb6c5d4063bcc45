"""Side-by-side Markdown table of bench results (one row per run of every file), ratios to the first file."""

from __future__ import annotations

import json
import math
from pathlib import Path


def load_result(path: str | Path) -> dict:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable kvfleet bench result ({e})") from e
    if not isinstance(data, dict) or "runs" not in data:
        raise ValueError(f"{path}: not a kvfleet bench result (no 'runs'); write one with `kvfleet bench run --out`")
    return data


def _f(x, fmt: str = "{:.1f}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


COLUMNS = ("target", "scenario", "load", "ok/all", "TTFT p50", "TTFT p99", "TPOT p50", "ITL p99", "E2E p50",
           "E2E p99", "out tok/s", "goodput req/s", "prefix hit", "KV peak", "out tok/s vs first")


def rows(results: list[dict]) -> list[list[str]]:
    """One row per run; the last column is out tok/s over the first file's run of the same scenario and load."""
    first = {(r["scenario"], run["load"]): run["summary"]["output_tok_s"] for r in results[:1] for run in r["runs"]}
    out = []
    for res in results:
        for run in res["runs"]:
            s, fleet = run["summary"], run.get("fleet") or {}
            ref = first.get((res["scenario"], run["load"]))
            ratio = s["output_tok_s"] / ref if ref else None
            out.append([res["name"], res["scenario"], run["load"], f"{s['completed']}/{s['requests']}",
                        _f(s["ttft_ms"]["p50"]), _f(s["ttft_ms"]["p99"]), _f(s["tpot_ms"]["p50"]),
                        _f(s["itl_ms"]["p99"]), _f(s["e2e_ms"]["p50"], "{:.0f}"), _f(s["e2e_ms"]["p99"], "{:.0f}"),
                        _f(s["output_tok_s"]), _f(s["goodput_req_s"], "{:.2f}"),
                        _f(fleet.get("prefix_hit_rate"), "{:.1%}"), _f(fleet.get("kv_usage_max"), "{:.1%}"),
                        _f(ratio, "x{:.2f}")])
    return out


def markdown(results: list[dict]) -> str:
    slos = sorted({run["summary"]["slo"] for r in results for run in r["runs"]})
    head = ("Latencies in ms; goodput = successful requests/s meeting the SLO (" + "; ".join(slos) + "); "
            "prefix hit and KV peak from the engines' /metrics over the run.\n\n")
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(results)]
    errors = [f"- {r['name']} {r['scenario']} {run['load']}: {run['summary']['errors']}"
              for r in results for run in r["runs"] if run["summary"]["errors"]]
    return head + "\n".join(lines) + ("\n\nErrors by type:\n" + "\n".join(errors) if errors else "") + "\n"

"""`kvfleet bench`: load an OpenAI-compatible endpoint with your traffic's shape and report it.

    kvfleet bench run --target http://127.0.0.1:8000 --scenario multi-turn --concurrency 4 --num 16 --out a.json
    kvfleet bench run --target URL --scenario sharegpt --rates 0.5 1 2 --num 32 --out sweep.json --plots plots/
    kvfleet bench run --target URL --trace my_trace.jsonl --replay-times --out replay.json
    kvfleet bench run --target URL --scenario short-short --rate 2 --driver guidellm --out g.json
    kvfleet bench report a.json b.json --plots plots/        # Markdown table, side by side
    kvfleet bench matrix --small                             # the stress matrix (kvfleet/bench/matrix.py)

Results are JSON (summary per run, fleet metrics from /metrics, every request's record); `report` prints
the Markdown table and writes PNG plots.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from kvfleet.bench.fleet_metrics import Scraper, engine_metric_urls
from kvfleet.bench.metrics import Slo, summarize
from kvfleet.bench.report import load_result, markdown
from kvfleet.bench.runner import Load, RequestOptions, run_load
from kvfleet.bench.scenarios import PRESETS, build, read_trace
from kvfleet.peers import mooncake_trace


def add_run_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--target", required=True, help="base URL of an OpenAI-compatible server (router or engine)")
    ap.add_argument("--name", default=None, help="this target's name in reports (default: its URL)")
    ap.add_argument("--model", default="smollm2", help="the `model` field of each request")
    ap.add_argument("--api-key", default=os.environ.get("KVFLEET_API_KEY"), help="bearer key (env KVFLEET_API_KEY)")
    w = ap.add_mutually_exclusive_group()
    w.add_argument("--scenario", choices=sorted(PRESETS), default=None, help="a stress-matrix preset")
    w.add_argument("--trace", default=None, help="replay a JSONL trace (ours or Mooncake's)")
    w.add_argument("--mooncake", action="store_true",
                   help="replay the Mooncake trace (path from env KVFLEET_MOONCAKE_TRACE or KVFLEET_SHARED_DIR)")
    ap.add_argument("--num", type=int, default=16, help="conversations (presets) or trace lines to send")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every preset length (0.25: a quick run)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="multiply a trace's arrival times")
    ap.add_argument("--mooncake-token-scale", type=float, default=1 / 16,
                    help="multiply Mooncake's token lengths (default 1/16: sized for SmolLM2 on CPUs)")
    lo = ap.add_mutually_exclusive_group()
    lo.add_argument("--concurrency", type=int, nargs="+", default=None, help="closed loop: workers (a sweep if several)")
    lo.add_argument("--rate", "--rates", dest="rate", type=float, nargs="+", default=None,
                    help="open loop: Poisson conversation arrivals per second (a sweep if several)")
    lo.add_argument("--replay-times", action="store_true", help="send a trace's requests at its own times")
    ap.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO: TTFT bound")
    ap.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput SLO: TPOT bound")
    ap.add_argument("--slo-e2e-ms", type=float, default=None, help="goodput SLO: end-to-end bound")
    ap.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                    help="let requests stop at EOS (default: ask for ignore_eos, so outputs have their max_tokens)")
    ap.add_argument("--think-s", type=float, default=0.0, help="pause between a conversation's turns")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--metrics-url", action="append", default=None,
                    help="engine /metrics base URL (repeatable; default: the target's, or its router's replicas)")
    ap.add_argument("--metrics-interval", type=float, default=1.0)
    ap.add_argument("--driver", choices=("native", "guidellm"), default="native",
                    help="native (kvfleet's driver: multi-turn, per-chunk records) or guidellm (single-turn presets)")
    ap.add_argument("--guidellm-tokenizer", default=None,
                    help="tokenizer directory guidellm sizes its synthetic text with (default: $KVFLEET_PEERS_DIR/smollm2-hf)")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    ap.add_argument("--out", default=None, help="write the result JSON here")
    ap.add_argument("--plots", default=None, help="write PNG plots into this folder")


def workload(a: argparse.Namespace):
    if a.trace or a.mooncake:
        path = a.trace or mooncake_trace()
        try:
            convs = read_trace(path, a.num, seed=a.seed, time_scale=a.time_scale,
                               mooncake_token_scale=a.mooncake_token_scale)
        except (OSError, ValueError) as e:
            raise SystemExit(f"--trace: {e}") from e
        return ("mooncake" if a.mooncake else Path(path).stem), convs
    name = a.scenario or "short-short"
    return name, build(name, a.num, a.seed, a.scale)


def loads(a: argparse.Namespace) -> list[Load]:
    try:
        if a.replay_times:
            return [Load(replay=True)]
        if a.rate:
            return [Load(rate=r) for r in a.rate]
        return [Load(concurrency=c) for c in (a.concurrency or [4])]
    except ValueError as e:
        raise SystemExit(str(e)) from e


def validate(a: argparse.Namespace) -> None:
    for flag, v, ok in (("--num", a.num, a.num >= 1), ("--scale", a.scale, a.scale > 0),
                        ("--time-scale", a.time_scale, a.time_scale > 0),
                        ("--metrics-interval", a.metrics_interval, a.metrics_interval > 0)):
        if not ok:
            raise SystemExit(f"{flag} must be positive, got {v}")
    if a.replay_times and not (a.trace or a.mooncake):
        raise SystemExit("--replay-times needs --trace or --mooncake")
    if not a.target.startswith(("http://", "https://")):
        raise SystemExit(f"--target must be an http(s) URL, got {a.target!r}")


async def run_native(a, scenario: str, convs, load: Load, metric_urls: list[str]) -> dict:
    from tqdm import tqdm

    opts = RequestOptions(a.model, a.api_key, a.ignore_eos, 0.0, a.request_timeout, a.think_s)
    total = sum(len(c.turns) for c in convs)
    with tqdm(total=total, desc=f"{scenario} {load.label()}", unit="req", disable=not a.progress,
              file=sys.stderr) as bar:
        async with Scraper(metric_urls, a.metrics_interval) as scraper:
            records, wall = await run_load(a.target, convs, load, opts, scenario=scenario, seed=a.seed, progress=bar)
    return {"records": records, "wall_s": wall, "fleet": scraper.summary()}


def run(a: argparse.Namespace) -> dict:
    validate(a)
    scenario, convs = workload(a)
    slo = Slo(a.slo_ttft_ms, a.slo_tpot_ms, a.slo_e2e_ms)
    metric_urls = a.metrics_url if a.metrics_url is not None else engine_metric_urls(a.target)
    result = {"kvfleet_bench": 1, "name": a.name or a.target, "target": a.target, "driver": a.driver,
              "scenario": scenario, "num": len(convs), "seed": a.seed, "scale": a.scale,
              "requests_per_run": sum(len(c.turns) for c in convs), "metrics_urls": metric_urls, "runs": []}
    for load in loads(a):
        if a.driver == "guidellm":
            from kvfleet.bench.guidellm_driver import run_guidellm
            got = run_guidellm(a, scenario, load, metric_urls)
        else:
            got = asyncio.run(run_native(a, scenario, convs, load, metric_urls))
        summary = summarize(got["records"], slo, got["wall_s"])
        if got.get("itl_ms"):  # guidellm keeps no per-chunk times: its own ITL percentiles
            summary["itl_ms"] = got["itl_ms"]
        result["runs"].append({"load": load.label(), "rate": load.rate, "concurrency": load.concurrency,
                               "summary": summary, "fleet": got["fleet"],
                               "records": [r.to_json() for r in got["records"]]})
        print(markdown([{**result, "runs": result["runs"][-1:]}]), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfleet bench", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_run_args(sub.add_parser("run", help="load one target and record the run"))
    rp = sub.add_parser("report", help="Markdown table of several results side by side (and plots)")
    rp.add_argument("results", nargs="+", help="result JSON files from `kvfleet bench run --out`")
    rp.add_argument("--plots", default=None, help="write PNG plots into this folder")
    sub.add_parser("matrix", help="the stress matrix on the local fleet (see --help)", add_help=False)
    if argv and argv[0] == "matrix":
        from kvfleet.bench.matrix import main as matrix_main
        return matrix_main(argv[1:])
    a = ap.parse_args(argv)
    if a.cmd == "report":
        try:
            results = [load_result(p) for p in a.results]
        except ValueError as e:
            raise SystemExit(f"report: {e}") from e
        print(markdown(results))
        if a.plots:
            from kvfleet.bench.plots import write_plots
            for p in write_plots(results, a.plots):
                print(f"wrote {p}")
        return 0
    result = run(a)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {a.out}")
    if a.plots:
        from kvfleet.bench.plots import write_plots
        for p in write_plots([result], a.plots):
            print(f"wrote {p}")
    return 0 if all(run["summary"]["failed"] == 0 for run in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())

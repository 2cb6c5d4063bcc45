"""Goodput of colocated and disaggregated fleets of the same size, as a markdown table (docs/results.md).

    python -m kvfleet.sim.goodput --format mooncake --replicas 16 --splits colocated,1:3,1:1,3:1,7:1
    python -m kvfleet.sim.goodput --format sessions --sessions 3000 --session-rate 10 --replicas 64

The engines' speed is fixed per fleet size by `--offered-load` at the workload's own rate (as in table.py: its
prompt tokens, prefilled with no cache at all, would keep the fleet that busy), then the workload is replayed at
each of `--rates` times its rate (arrival times divided) on every fleet shape: `colocated` (every replica
prefills and decodes) and each prefill:decode split (disagg.py). Each cell is the SLO attainment at that rate
(slo.py: the fraction of requests with TTFT and TPOT within the targets); goodput is the highest rate before the
first whose attainment is below `--goal`, in requests per second. A shape stops at its first rate that falls
short (its later cells are `-`); the last column gives its TTFT p90 and TPOT p90 there, to show which target
broke. `--ttft-slo` and `--tpot-slo` are seconds at the cost model's own speed and are divided by the run's
speedup, so every fleet size is held to the same targets relative to its engines (the header prints them).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from kvfleet.sim.cost import COST_MODELS
from kvfleet.sim.disagg import Disagg, prefill_count
from kvfleet.sim.fleet import SimConfig, Simulator
from kvfleet.sim.slo import SLO, attainment, goodput, percentile
from kvfleet.sim.table import _ints, add_link_args, add_workload_args, pull_link, speedup, workload
from kvfleet.sim.workload import SimWorkload
from router.pools.choice import SLO_UNATTAINABLE

DEFAULT_SLO = {"mooncake": (100.0, 0.15), "sessions": (10.0, 0.15)}  # (TTFT, TPOT) s at the cost model's speed


def at_rate(wl: SimWorkload, factor: float) -> SimWorkload:
    """The workload with its sessions arriving `factor` times as fast (start times divided)."""
    return dataclasses.replace(wl, sessions=tuple(dataclasses.replace(s, start_s=s.start_s / factor)
                                                  for s in wl.sessions))


def request_rate(wl: SimWorkload) -> float:
    """Requests per second over the span of session starts."""
    return wl.num_requests / (max(s.start_s for s in wl.sessions) or 1.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(ap)
    add_link_args(ap)
    ap.add_argument("--replicas", default="16,64")
    ap.add_argument("--policy", default="kv", help="placement over the (prefill) replicas")
    ap.add_argument("--splits", default="colocated,1:3,1:1,3:1,7:1",
                    help="fleet shapes: colocated, or prefill:decode ratios (or prefill counts)")
    ap.add_argument("--rates", default="0.25,0.5,0.75,1,1.25,1.5,2", help="multiples of the workload's rate")
    ap.add_argument("--offered-load", type=float, default=0.9)
    ap.add_argument("--ttft-slo", type=float, default=None, help="TTFT target, s at the cost model's speed")
    ap.add_argument("--tpot-slo", type=float, default=None, help="TPOT target, s at the cost model's speed")
    ap.add_argument("--goal", type=float, default=0.9, help="the fraction of requests that must meet both")
    ap.add_argument("--kv-tokens-per-replica", type=int, default=819_200)
    ap.add_argument("--cost-model", choices=sorted(COST_MODELS), default="smollm2-1core")
    ap.add_argument("--decode-policy", default="least-load")
    ap.add_argument("--slo-placement", action="store_true",
                    help="every request carries the TTFT and TPOT targets: the router places it where its latency "
                         "models (fitted on the simulated streams) predict both met, and refuses it (429 "
                         "slo_unattainable, a miss) where none is, as a pool does by default; the engines serve "
                         "prompts earliest TTFT deadline first and keep steps under the TPOT target, as kvfleet's do")
    ap.add_argument("--slo-unattainable", choices=SLO_UNATTAINABLE, default="refuse",
                    help="with --slo-placement: what the router does with a request no replica is predicted to meet "
                         "(the pool setting; default refuse)")
    a = ap.parse_args(argv)
    if a.format == "sessions" and a.session_rate is None:
        raise SystemExit("goodput: generated sessions need --session-rate (an open loop has a rate to scale)")
    ttft, tpot = DEFAULT_SLO[a.format]
    slo = SLO(a.ttft_slo or ttft, a.tpot_slo or tpot, a.goal)
    cost = COST_MODELS[a.cost_model]
    base = workload(a, 0)
    rates = sorted(float(r) for r in a.rates.split(","))
    link = pull_link(a)
    print(f"<!-- {base.num_requests} requests at {request_rate(base):.3f}/s (x1); SLO at the cost model's speed: "
          f"TTFT {slo.ttft_s:g} s, TPOT {slo.tpot_s:g} s, {slo.goal:.0%} of requests -->")
    print("| replicas | fleet | speedup | TTFT / TPOT target | " + " | ".join(f"x{r:g}" for r in rates)
          + " | goodput, req/s | vs colocated | refused at the goodput | TTFT p90 / TPOT p90 where it fell short |")
    print("|---|---|---|---|" + "---|" * len(rates) + "---|---|---|---|")
    for n in _ints(a.replicas):
        s = speedup(base, n, a.offered_load, cost.prefill_token_s)
        target = slo.scaled(s)
        colocated: float | None = None
        for split in a.splits.split(","):
            disagg = None if split == "colocated" else Disagg(prefill_count(split, n), link, a.decode_policy)
            label = "colocated" if disagg is None else f"{split} ({disagg.prefill_replicas}P + " \
                f"{n - disagg.prefill_replicas}D)"
            cfg = SimConfig(n, a.policy, cost.scaled(s), a.kv_tokens_per_replica, disagg=disagg,
                            ttft_target_s=target.ttft_s if a.slo_placement else None,
                            tpot_target_s=target.tpot_s if a.slo_placement else None,
                            slo_unattainable=a.slo_unattainable)
            cells: list[str] = []
            points: list[tuple[float, float]] = []
            short = "-"
            refused: list[float] = []  # the share refused at each rate met
            t0 = time.perf_counter()
            for r in rates:
                wl = at_rate(base, r)
                sim = Simulator(cfg, wl)
                sim.run()
                lat = sim.latencies()
                att = attainment(lat, target)
                points.append((r * request_rate(base), att))
                cells.append(f"{att:.2f}")
                if att >= slo.goal:
                    refused.append(sim.refused / len(lat))
                else:
                    ttfts = sorted(x.ttft_s if x.ttft_s is not None else float("inf") for x in lat)
                    tpots = sorted(x.tpot_s for x in lat if x.tpot_s is not None)
                    short = f"{percentile(ttfts, 0.9):.2f} s / {percentile(tpots, 0.9) * 1e3:.0f} ms"
                    break
            cells += ["-"] * (len(rates) - len(cells))
            good = goodput(points, slo.goal)
            if disagg is None:
                colocated = good
            ratio = f"{good / colocated:.2f}" if colocated else "-"
            print(f"| {n} | {label} | {s:.2f} | {target.ttft_s:.3g} s / {target.tpot_s * 1e3:.3g} ms | "
                  + " | ".join(cells) + f" | {good:.3f} | {ratio} | {refused[-1] if refused else 0:.1%} | {short} |",
                  flush=True)
            print(f"<!-- {n} {split}: {time.perf_counter() - t0:.0f} s -->", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

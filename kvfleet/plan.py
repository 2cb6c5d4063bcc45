"""`kvfleet plan`: the fewest replicas that meet latency targets at a request rate, found with the fleet simulator.

    kvfleet plan --format sessions --sessions 300 --rate 6 --ttft-ms 8000 --tpot-ms 100
    kvfleet plan --format mooncake --trace conversation_trace.jsonl --rate 2 --ttft-ms 30000 --tpot-ms 200 \
        --engine-speedup 40
    kvfleet profile my_trace.jsonl --json > profile.json
    kvfleet plan --profile profile.json --ttft-ms 2000 --tpot-ms 100      # at the profile's own rate
    kvfleet plan --format sessions --sessions 300 --rate 6 --ttft-ms 8000 --tpot-ms 100 --disagg

The workload (a Mooncake-format trace, generated multi-turn sessions: the flags `kvfleet sim` takes, or with
`--profile` sessions generated to the shape `kvfleet profile --json` measured: kvfleet/sim/workload.py
from_profile) is replayed at `--rate` requests per second (default with --profile: the profile's own rate) (its arrival times scaled) through the router's own placement core (`--policy`,
default `kv`) over simulated engines (kvfleet/sim: the cost model of the bundled model on one core, `--engine-
speedup` times faster for a bigger machine), each replica holding `--kv-tokens-per-replica` tokens of KV cache,
every request carrying the targets (as the router sends a pool's or tenant's targets: it places by them, refuses
what no replica is predicted to meet as a pool does by default, a miss, and the engines serve prompts earliest TTFT
deadline first and keep steps under the TPOT target). A
size meets the targets when at least `--goal` of the requests have both TTFT and TPOT within them (DistServe's
attainment, kvfleet/sim/slo.py). Attainment grows with the fleet, so the search doubles the size until one meets
the targets and then bisects between the last that did not and the first that did; it prints every size it tried,
and the answer: the smallest size that meets the targets, the one below it not. When two doublings in a row
raise attainment by less than 0.01, it stops: the engines are too slow for the targets however many there are.

With `--disagg` it also plans the pool disaggregated (kvfleet/sim/disagg.py: prefill replicas hand each prompt's KV
over a `--link-gbps` link to a decode replica): the fewest prefill and decode replicas that meet the targets
(kvfleet/split_search.py: each side sized on its own target with the colocated size on the other, grown where it
helps, shrunk while it meets), every pair it simulated printed with the shares meeting TTFT, TPOT and both.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from kvfleet.sim.cost import COST_MODELS, CostModel
from kvfleet.sim.disagg import Disagg
from kvfleet.sim.fleet import SimConfig, Simulator
from kvfleet.sim.goodput import at_rate, request_rate
from kvfleet.sim.link import PullLink
from kvfleet.sim.slo import SLO, attainment, percentile
from kvfleet.sim.table import add_workload_args, workload
from kvfleet.sim.workload import SimWorkload, from_profile
from kvfleet.split_search import Shares, Split, fewest_split
from router.pools.sizing import smallest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfleet plan", description=__doc__.split("\n\n")[0])
    add_workload_args(ap)
    ap.add_argument("--profile", default=None,
                    help="a `kvfleet profile --json` file: sessions generated to its shape (instead of --format)")
    ap.add_argument("--requests", type=int, default=3000, help="with --profile: requests to generate")
    ap.add_argument("--rate", type=float, default=None,
                    help="requests per second the fleet must serve (required, except with a --profile that has one)")
    ap.add_argument("--ttft-ms", type=float, required=True, help="time-to-first-token target, milliseconds")
    ap.add_argument("--tpot-ms", type=float, required=True, help="time-per-output-token target, milliseconds")
    ap.add_argument("--goal", type=float, default=0.9, help="share of requests that must meet both (default 0.9)")
    ap.add_argument("--policy", default="kv")
    ap.add_argument("--cost-model", choices=sorted(COST_MODELS), default="smollm2-1core")
    ap.add_argument("--engine-speedup", type=float, default=1.0, help="engines this many times the cost model's speed")
    ap.add_argument("--kv-tokens-per-replica", type=int, default=819_200)
    ap.add_argument("--max-replicas", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--disagg", action="store_true",
                    help="also plan the pool disaggregated: the fewest prefill and decode replicas that meet the targets")
    ap.add_argument("--link-gbps", type=float, default=1.0,
                    help="with --disagg: the prefill-to-decode KV link's bandwidth, GB/s (default 1)")
    ap.add_argument("--link-latency-ms", type=float, default=2.0,
                    help="with --disagg: its set-up time per hand-over, ms (default 2)")
    ap.add_argument("--kv-bytes-per-token", type=int, default=23_040,
                    help="with --disagg: KV bytes per prompt token (default SmolLM2-135M's)")
    a = ap.parse_args(argv)
    if a.profile and a.trace:
        ap.error("give --profile or --trace, not both")
    profile = _read_profile(ap, a.profile) if a.profile else None
    if a.rate is None:
        a.rate = ((profile or {}).get("arrivals") or {}).get("rate_per_s")
        if a.rate is None:
            ap.error("--rate is required" + (" (the profile has no arrival rate)" if profile else ""))
    if a.requests < 1:
        ap.error(f"--requests must be >= 1, got {a.requests}")
    for name in ("rate", "ttft_ms", "tpot_ms", "engine_speedup", "link_gbps", "kv_bytes_per_token"):
        if not getattr(a, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(a, name)}")
    if not a.link_latency_ms >= 0:
        ap.error(f"--link-latency-ms must be >= 0, got {a.link_latency_ms}")
    if not 0 < a.goal <= 1:
        ap.error(f"--goal must be in (0, 1], got {a.goal}")
    if a.max_replicas < 1:
        ap.error(f"--max-replicas must be >= 1, got {a.max_replicas}")
    if a.format == "sessions" and a.session_rate is None and a.concurrency is None:
        a.session_rate = 1.0  # an open loop: --rate scales it
    if profile is not None:
        try:
            base = from_profile(profile, a.requests, a.rate, a.seed, a.block_size)
        except ValueError as e:
            ap.error(f"--profile {a.profile}: {e}")
    else:
        base = workload(a, a.seed)
    wl = at_rate(base, a.rate / request_rate(base))
    slo = SLO(a.ttft_ms / 1000, a.tpot_ms / 1000, a.goal)
    cost = COST_MODELS[a.cost_model].scaled(a.engine_speedup)
    print(f"{wl.num_requests} requests at {a.rate:g}/s; targets TTFT {a.ttft_ms:g} ms, TPOT {a.tpot_ms:g} ms for "
          f"{a.goal:.0%}; engines: {a.cost_model} x{a.engine_speedup:g}, {a.kv_tokens_per_replica:,} KV tokens each; "
          f"policy {a.policy}")
    # more misses than this and the goal is out of reach: a size's run stops there (a small fleet under a heavy
    # load would otherwise simulate every queued request's late first token)
    limit = int(wl.num_requests * (1 - a.goal) + 1e-9)
    if sum(1 for s in wl.sessions for t in s.turns if not idle_meets(t.output_tokens, cost, slo)) > limit:
        print("no fleet meets the targets (a request alone on an idle replica misses them: the targets need faster "
              "engines, not more of them)")
        return 1
    tried: dict[int, float] = {}  # sizes run to the end: their attainment

    def meets(n: int) -> bool:
        sim = Simulator(SimConfig(n, a.policy, cost, a.kv_tokens_per_replica, ttft_target_s=slo.ttft_s,
                                  tpot_target_s=slo.tpot_s, stop_after_misses=limit), wl)
        sim.run()
        lat = sim.latencies()
        if sim.stopped:
            print(f"  {n:4d} replicas: attainment below {a.goal:g}: more than {limit:,} of {wl.num_requests:,} "
                  f"requests missed ({sim.refused:,} refused) by {sim.now:.0f} s, where the run stopped", flush=True)
            return False
        refused = f", refused {sim.refused / len(lat):.1%}" if sim.refused else ""
        tried[n] = att = attainment(lat, slo)
        ttfts = sorted(x.ttft_s if x.ttft_s is not None else float("inf") for x in lat)
        tpots = sorted(x.tpot_s for x in lat if x.tpot_s is not None)
        tpot90 = f"{percentile(tpots, 0.9) * 1000:.0f} ms" if tpots else "-"
        print(f"  {n:4d} replicas: attainment {att:.3f}, TTFT p90 {percentile(ttfts, 0.9):.2f} s, TPOT p90 {tpot90}"
              f"{refused}", flush=True)
        return att >= slo.goal

    def stalled() -> bool:
        """Two doublings in a row that raised attainment by less than 0.01: the engines are too slow for the
        targets whatever their number (a request alone on an idle replica misses them)."""
        sizes = sorted(tried)
        return len(sizes) >= 3 and tried[sizes[-1]] - tried[sizes[-3]] < 0.01

    n = smallest(meets, a.max_replicas, stalled)
    if n is None:
        best = max(tried.values(), default=None)
        why = (f"attainment stops growing at about {best:.3f}: the targets need faster engines, not more of them"
               if stalled() else f"up to {a.max_replicas} replicas reach "
               + (f"{best:.3f}" if best is not None else f"less than {a.goal:g}"))
        print(f"no fleet meets the targets ({why})")
        if not a.disagg:
            return 1
    else:
        below = (f"; {n - 1} reach {tried[n - 1]:.3f}" if n - 1 in tried
                 else f"; {n - 1} stay below {a.goal:g}" if n > 1 else "")
        print(f"plan: {n} replicas (attainment {tried[n]:.3f} >= {a.goal:g}{below})")
    if not a.disagg:
        return 0
    link = PullLink(a.link_gbps * 1e9, a.link_latency_ms / 1000, a.kv_bytes_per_token)
    split = plan_split(wl, a, cost, slo, link, n if n is not None else max(tried, default=a.max_replicas))
    return 0 if split is not None or n is not None else 1


def plan_split(wl: SimWorkload, a: argparse.Namespace, cost: CostModel, slo: SLO, link: PullLink,
               ample: int) -> Split | None:
    """`--disagg`: the fewest prefill and decode replicas (kvfleet/split_search.py), each side sized with
    `ample` replicas on the other (the colocated plan's size), every pair simulated whole and printed."""
    print(f"disaggregated: prompts' KV handed over at {a.link_gbps:g} GB/s + {a.link_latency_ms:g} ms, decode "
          f"replicas chosen least-load; each side sized with {ample} on the other")

    def run(p: int, d: int) -> Shares:
        sim = Simulator(SimConfig(p + d, a.policy, cost, a.kv_tokens_per_replica, ttft_target_s=slo.ttft_s,
                                  tpot_target_s=slo.tpot_s, disagg=Disagg(p, link)), wl)
        sim.run()
        lat = sim.latencies()
        s = Shares(attainment(lat, SLO(slo.ttft_s, math.inf)), attainment(lat, SLO(math.inf, slo.tpot_s)),
                   attainment(lat, slo))
        print(f"  {p:4d} prefill + {d:4d} decode: attainment {s.both:.3f} (TTFT met {s.ttft:.3f}, TPOT met "
              f"{s.tpot:.3f})", flush=True)
        return s

    split = fewest_split(run, slo.goal, ample, a.max_replicas)
    if split is None:
        print(f"no disaggregated split of up to {a.max_replicas} replicas meets the targets")
        return None
    print(f"plan (disaggregated): {split.prefill} prefill + {split.decode} decode = {split.prefill + split.decode} "
          f"replicas (attainment {split.shares.both:.3f} >= {slo.goal:g}; one fewer on either side stays below)")
    return split


def idle_meets(output_tokens: int, cost: CostModel, slo: SLO) -> bool:
    """Whether a request could meet the targets at best: alone on an idle replica with all of its prompt but one
    token cached (first token in one step of one prompt token; later ones in steps of its decode alone)."""
    return (cost.step_s(1, 0) <= slo.ttft_s
            and (output_tokens <= 1 or cost.step_s(0, 1) <= slo.tpot_s))


def _read_profile(ap: argparse.ArgumentParser, path: str) -> dict:
    try:
        profile = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        ap.error(f"--profile {path}: {e}")
    if not isinstance(profile, dict):
        ap.error(f"--profile {path}: not a `kvfleet profile --json` file")
    return profile


if __name__ == "__main__":
    sys.exit(main())

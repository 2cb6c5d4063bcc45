"""`kvfleet sim`: replay a trace through the router's policies over simulated engines; prints the results.

    kvfleet sim --trace ../shared/traces/mooncake_conversation_trace.jsonl --format mooncake --replicas 64 \\
        --policy kv --json
    kvfleet sim --format sessions --sessions 2000 --session-rate 2 --replicas 8 --policy kv --json
    kvfleet sim --format mooncake --replicas 8 --autoscale --min-replicas 8 --max-replicas 64 --json
    kvfleet sim --format mooncake --replicas 16 --tier-factor 4 --json          # a lower KV tier, 4x the pool
    kvfleet sim --format mooncake --replicas 16 --disagg-prefill 3:1 --ttft-slo 60 --tpot-slo 0.2 --json

The Mooncake trace is `--trace`, else $KVFLEET_MOONCAKE_TRACE, else ../shared/traces/ beside the checkout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from kvfleet.sim.cost import COST_MODELS
from kvfleet.sim.disagg import Disagg, prefill_count
from kvfleet.sim.fleet import Autoscale, SimConfig, Simulator
from kvfleet.sim.link import PullLink
from kvfleet.sim.slo import SLO, attainment
from kvfleet.sim.tier import TierSpec
from kvfleet.sim.workload import mooncake, multi_turn
from router.config import ScoringConfig
from router.routing.policies import POLICIES

_SCORING = [f.name for f in dataclasses.fields(ScoringConfig)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kvfleet sim", description=__doc__.split("\n")[0])
    ap.add_argument("--format", choices=("mooncake", "sessions"), default="mooncake")
    ap.add_argument("--trace", default=None, help="the Mooncake trace file (default: $KVFLEET_MOONCAKE_TRACE)")
    ap.add_argument("--limit", type=int, default=None, help="only the first N requests of the trace")
    ap.add_argument("--time-scale", type=float, default=1.0, help="multiply the trace's arrival times")
    ap.add_argument("--sessions", type=int, default=1000, help="generated sessions (--format sessions)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mean-user-tokens", type=float, default=200)
    ap.add_argument("--reply-tokens", type=int, default=80)
    ap.add_argument("--output-tokens", type=int, default=80)
    ap.add_argument("--system-prompts", type=int, default=2)
    ap.add_argument("--system-tokens", type=int, default=200)
    ap.add_argument("--think-s", type=float, default=0.5)
    ap.add_argument("--session-rate", type=float, default=None, help="new sessions per second (open loop)")
    ap.add_argument("--concurrency", type=int, default=None, help="sessions at a time (closed loop)")
    ap.add_argument("--block-size", type=int, default=32, help="generated sessions' block size")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--policy", choices=sorted(POLICIES), default="kv")
    ap.add_argument("--kv-tokens-per-replica", type=int, default=819_200,
                    help="prefix cache + running KV per replica, tokens (default ~ Llama-3-8B bf16 on one H200)")
    ap.add_argument("--cost-model", choices=sorted(COST_MODELS), default="smollm2-1core")
    ap.add_argument("--speedup", type=float, default=1.0, help="engines this many times faster than the cost model")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    for name in _SCORING:
        ap.add_argument("--" + name.replace("_", "-"), type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--autoscale", action="store_true", help="scale with the chart's HPA (targets below)")
    ap.add_argument("--min-replicas", type=int, default=1)
    ap.add_argument("--max-replicas", type=int, default=4)
    ap.add_argument("--target-kv-usage", type=float, default=0.8)
    ap.add_argument("--target-waiting", type=float, default=2.0)
    ap.add_argument("--scale-down-stabilization-s", type=float, default=600.0)
    ap.add_argument("--replica-start-s", type=float, default=60.0)
    ap.add_argument("--pull", action="store_true",
                    help="peer pulls: a replica lacking a prefix a peer holds pulls it when that is cheaper (issue 31)")
    ap.add_argument("--pull-gbps", type=float, default=1.0, help="the pull link's bandwidth, GB/s")
    ap.add_argument("--pull-latency-ms", type=float, default=2.0, help="the pull link's set-up time per pull")
    ap.add_argument("--kv-bytes-per-token", type=int, default=23_040, help="KV bytes per token (SmolLM2-135M's)")
    ap.add_argument("--tier-factor", type=float, default=0.0,
                    help="a lower KV tier on each replica of F x its pool's KV (0: none); evicted blocks go there")
    ap.add_argument("--tier-gbps", type=float, default=2.0, help="the tier's reload bandwidth, GB/s")
    ap.add_argument("--tier-latency-ms", type=float, default=1.0, help="the tier's set-up time per reload")
    ap.add_argument("--disagg-prefill", default=None, metavar="P|P:D",
                    help="disaggregate: P prefill replicas (or a prefill:decode ratio), the rest decode; the KV "
                         "moves over the pull link (--pull-gbps, --pull-latency-ms)")
    ap.add_argument("--decode-policy", choices=sorted(POLICIES), default="least-load",
                    help="how a disaggregated fleet picks the decode replica")
    ap.add_argument("--ttft-slo", type=float, default=None, help="with --tpot-slo: report the SLO attainment")
    ap.add_argument("--tpot-slo", type=float, default=None)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    return ap.parse_args(argv)


def build(a: argparse.Namespace) -> Simulator:
    if a.format == "mooncake":
        wl = mooncake(a.trace, a.limit, a.time_scale)
    else:
        if a.session_rate is None and a.concurrency is None:
            a.concurrency = 4
        wl = multi_turn(a.sessions, a.seed, turns=a.turns, mean_user_tokens=a.mean_user_tokens,
                        reply_tokens=a.reply_tokens, output_tokens=a.output_tokens, system_prompts=a.system_prompts,
                        system_tokens=a.system_tokens, session_rate=a.session_rate, concurrency=a.concurrency,
                        think_s=a.think_s, block_size=a.block_size)
    overrides = {}
    for name in _SCORING:
        v = getattr(a, name)
        if v is not None:
            default = getattr(ScoringConfig(), name)
            overrides[name] = type(default)(v)
    autoscale = None
    if a.autoscale:
        autoscale = Autoscale(a.min_replicas, a.max_replicas, a.target_kv_usage, a.target_waiting,
                              a.scale_down_stabilization_s, start_s=a.replica_start_s)
    link = PullLink(a.pull_gbps * 1e9, a.pull_latency_ms / 1e3, a.kv_bytes_per_token)
    tier = TierSpec(a.tier_factor, PullLink(a.tier_gbps * 1e9, a.tier_latency_ms / 1e3, a.kv_bytes_per_token)) \
        if a.tier_factor > 0 else None
    disagg = Disagg(prefill_count(a.disagg_prefill, a.replicas), link, a.decode_policy) \
        if a.disagg_prefill is not None else None
    cfg = SimConfig(a.replicas, a.policy, COST_MODELS[a.cost_model].scaled(a.speedup), a.kv_tokens_per_replica,
                    ScoringConfig(**overrides), a.max_num_seqs, a.max_batched_tokens, autoscale=autoscale,
                    pull=link if a.pull else None, tier=tier, disagg=disagg)
    return Simulator(cfg, wl)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if (a.ttft_slo is None) != (a.tpot_slo is None):
        raise SystemExit("kvfleet sim: give both --ttft-slo and --tpot-slo, or neither")
    t0 = time.perf_counter()
    sim = build(a)
    out = sim.run()
    if a.ttft_slo is not None and a.tpot_slo is not None:
        out["slo_attainment"] = round(attainment(sim.latencies(), SLO(a.ttft_slo, a.tpot_slo)), 4)
    out["wall_seconds"] = round(time.perf_counter() - t0, 1)
    if a.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:24} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

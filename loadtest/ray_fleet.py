r"""KV-aware routing on Ray Serve: the same seeded multi-turn workload as `router_bench policies` (shared system
prompts, each turn resending the whole history, streamed chat requests with `x-session-id`) through the Serve
application (deploy/ray/app.py) with 2 engine replicas, once per routing policy, and once against ONE replica
with twice the KV blocks (the whole fleet's cache in one place: the reference).

It prints per run the fleet's prefix-cache hit rate from the engines' own metrics (vllm:prefix_cache_hits over
vllm:prefix_cache_queries summed over the replicas, read from each replica's /metrics after the run; each run
is a fresh deployment, so the counters hold that run only) beside the same ratio summed from the responses'
`usage.prompt_tokens_details.cached_tokens`, the split of requests between replicas (`x-kvfleet-replica`),
TTFT, and: kv's hit rate over the single replica's (target >= 0.95), the largest replica's share of requests
(target <= 0.75), round-robin's hit rate beside kv's.

    python -m loadtest.ray_fleet                                   # 16 sessions x 4 turns, 4 in flight
    python -m loadtest.ray_fleet --policies kv,approx-prefix,round-robin --sessions 24 --turns 4

Each policy is a fresh deployment (fresh caches); Ray runs in this process and is shut down at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from deploy.ray.cli import SERVE_CONFIG, plan
from loadtest.ray_serve import deploy, engine_metrics, ray_serve, undeploy
from loadtest.router_bench import build_sessions, run_sessions
from router.routing.replicas import parse_engine_metrics


def app_args(ns, policy: str, replicas: int, num_blocks: int, threads: int) -> dict:
    args = plan(SERVE_CONFIG, replicas, ns.port, policy).args
    args["engine"] = {**args["engine"], "num_blocks": num_blocks, "num_threads": threads}
    args["num_cpus"] = 0.5  # logical: both replicas fit on a 2-core machine
    return args


def measure(url: str, sessions, ns, salt: str) -> dict:
    res = asyncio.run(run_sessions(url, sessions, ns, salt, None))
    loads = [parse_engine_metrics(text) for text in engine_metrics(res["by_replica"]).values()]
    queries, hits = sum(ld.prefix_queries for ld in loads), sum(ld.prefix_hits for ld in loads)
    res["hit_rate"] = hits / queries if queries else float("nan")
    total = sum(res["by_replica"].values())
    res["largest_share"] = max(res["by_replica"].values()) / total if total else float("nan")
    res.pop("trace")
    return res


def print_row(name: str, r: dict) -> None:
    print(f"{name:28s} hit {r['hit_rate']:6.1%} (usage {r['usage_hit_rate']:6.1%}, follow-ups home {r['follow_ups_home']:4.0%})  TTFT p50 "
          f"{r['ttft_p50_ms']:8.1f} ms  p99 {r['ttft_p99_ms']:8.1f} ms  {r['req_per_s']:5.2f} req/s  errors "
          f"{r['errors']}  split {sorted(r['by_replica'].values())}", flush=True)


def run(ns) -> dict:
    sessions = build_sessions(ns)
    cpus = os.cpu_count() or 1
    print(f"workload: {len(sessions)} sessions x {ns.turns} turns, {ns.system_prompts} system prompts of "
          f"~{ns.system_tokens} words, max_tokens {ns.max_tokens}, concurrency {ns.concurrency}; "
          f"{ns.replicas} replicas x {ns.num_blocks} blocks", flush=True)
    results: dict[str, dict] = {}
    with ray_serve(ns.port, num_cpus=max(cpus, 4)) as url:
        for i, policy in enumerate(ns.policies.split(",")):
            secs = deploy(app_args(ns, policy, ns.replicas, ns.num_blocks, max(1, cpus // ns.replicas)), url)
            print(f"  {policy}: deployed in {secs:.0f} s", flush=True)
            results[policy] = measure(url, sessions, ns, f"ray-{ns.seed}-{i}-{policy}")
            print_row(policy, results[policy])
            undeploy()
        if ns.single_reference:
            deploy(app_args(ns, "round-robin", 1, ns.num_blocks * ns.replicas, cpus), url)
            results["single-replica-whole-cache"] = measure(url, sessions, ns, f"ray-{ns.seed}-one")
            print_row("single-replica-whole-cache", results["single-replica-whole-cache"])
            undeploy()
    summary = {}
    ref = results.get("single-replica-whole-cache", {}).get("hit_rate")
    for name, r in results.items():
        if name != "single-replica-whole-cache":
            summary[name] = {"hit_rate": r["hit_rate"], "largest_share": r["largest_share"],
                             "hit_rate_vs_single": r["hit_rate"] / ref if ref else float("nan")}
            print(f"{name:12s} hit rate / single replica {summary[name]['hit_rate_vs_single']:.3f} (target >= 0.95)"
                  f"  largest replica's share {r['largest_share']:.2f} (target <= 0.75)", flush=True)
    return {"results": results, "summary": summary}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ray_fleet", description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default="kv,round-robin")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-prompts", type=int, default=2)
    p.add_argument("--system-tokens", type=int, default=192)
    p.add_argument("--mean-user-tokens", type=float, default=60)
    p.add_argument("--reply-tokens", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4, help="sessions in flight at once")
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per replica")
    p.add_argument("--no-single-reference", dest="single_reference", action="store_false")
    p.add_argument("--port", type=int, default=8431)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    ns.api = "chat"
    out = run(ns)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

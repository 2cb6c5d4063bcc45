"""Many `kvfleet sim` runs on one workload, as a markdown table (the tables in docs/results.md).

    python -m kvfleet.sim.table --format mooncake --replicas 8,16,64 --offered-load 0.9
    python -m kvfleet.sim.table --format sessions --sessions 10000 --session-rate 20 --replicas 8,16,64 \\
        --offered-load 0.9
    python -m kvfleet.sim.table --format sessions --sessions 16 --concurrency 4 --output-tokens 8 \\
        --replicas 2 --policies kv,round-robin --seeds 0-9 --reference      # issue 15's two slow engines
    python -m kvfleet.sim.table --format mooncake --replicas 64 --offered-load 0.9 --policies kv,kv+pull
    python -m kvfleet.sim.table --format mooncake --replicas 16,64 --offered-load 0.9 --policies kv,kv+tier,kv+pull+tier

`--offered-load L` sets each run's engine speed so that the workload's prompt tokens, prefilled with no cache
at all, would keep the fleet busy a fraction L of the trace's span (the cost model's speed otherwise):
the same work per replica at every fleet size, so the columns differ by how the cache splits, not by load.
`--reference` adds one replica (the same KV per replica) running the whole workload: its hit rate is the
"one engine" reference of loadtest/vllm_fleet.py. A policy written `NAME+pull` runs with peer pulls over a link
of `--pull-gbps` and `--pull-latency-ms` (kvfleet/sim/link.py's PullLink); the `pulled` column counts the blocks
pulled instead of computed (they count as hits). `NAME+tier` gives every replica a lower KV tier of
`--tier-factor` x its KV, reloaded at `--tier-gbps` and `--tier-latency-ms` (kvfleet/sim/tier.py); a `reloaded`
column counts the blocks reloaded from tiers instead of computed (they count as hits too). `NAME+pull+tier`: both.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from kvfleet.sim.cost import COST_MODELS
from kvfleet.sim.fleet import SimConfig, Simulator
from kvfleet.sim.link import PullLink
from kvfleet.sim.tier import TierSpec
from kvfleet.sim.workload import SimWorkload, mooncake, multi_turn
from router.config import ScoringConfig

ALL = "kv,approx-prefix,session,least-load,round-robin"
EXTRAS = ("pull", "tier")  # what a policy may add after a "+"


def _ints(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def workload(a: argparse.Namespace, seed: int) -> SimWorkload:
    if a.format == "mooncake":
        return mooncake(a.trace, a.limit, a.time_scale)
    return multi_turn(a.sessions, seed, turns=a.turns, mean_user_tokens=a.mean_user_tokens, reply_tokens=a.reply_tokens,
                      output_tokens=a.output_tokens, system_prompts=a.system_prompts, system_tokens=a.system_tokens,
                      session_rate=a.session_rate, concurrency=a.concurrency, think_s=a.think_s,
                      block_size=a.block_size)


def speedup(wl: SimWorkload, replicas: int, offered_load: float | None, prefill_token_s: float) -> float:
    if offered_load is None:
        return 1.0
    tokens = sum(t.prompt_tokens for s in wl.sessions for t in s.turns)
    span = max(s.start_s for s in wl.sessions) or 1.0
    return tokens * prefill_token_s / (span * replicas * offered_load)


def agg(outs: list[dict], key: str, fmt: str = "{:.3f}") -> str:
    """One value, or the mean over seeds with its range."""
    vals = [o[key] for o in outs if o.get(key) is not None]
    if not vals:
        return "-"
    if len(vals) == 1:
        return fmt.format(vals[0])
    return f"{fmt.format(statistics.mean(vals))} ({fmt.format(min(vals))}-{fmt.format(max(vals))})"


def policy_spec(policy: str) -> tuple[str, set[str]]:
    """`kv+pull+tier` -> ("kv", {"pull", "tier"})."""
    name, *extras = policy.split("+")
    unknown = set(extras) - set(EXTRAS)
    if unknown:
        raise SystemExit(f"policy {policy!r}: unknown {'+'.join(sorted(unknown))} (after '+': {', '.join(EXTRAS)})")
    return name, set(extras)


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The workload's flags (what `workload()` reads), shared with goodput.py."""
    ap.add_argument("--format", choices=("mooncake", "sessions"), default="mooncake")
    ap.add_argument("--trace", default=None)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--sessions", type=int, default=10000)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--mean-user-tokens", type=float, default=200)
    ap.add_argument("--reply-tokens", type=int, default=80)
    ap.add_argument("--output-tokens", type=int, default=80)
    ap.add_argument("--system-prompts", type=int, default=2)
    ap.add_argument("--system-tokens", type=int, default=200)
    ap.add_argument("--think-s", type=float, default=0.5)
    ap.add_argument("--session-rate", type=float, default=None)
    ap.add_argument("--concurrency", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=32)


def add_link_args(ap: argparse.ArgumentParser) -> None:
    """The pull link's flags, shared with goodput.py (its prefill -> decode hand-off crosses the same link)."""
    ap.add_argument("--pull-gbps", type=float, default=1.0, help="the pull link (NAME+pull, hand-offs), GB/s")
    ap.add_argument("--pull-latency-ms", type=float, default=2.0)
    ap.add_argument("--kv-bytes-per-token", type=int, default=23_040)


def pull_link(a: argparse.Namespace) -> PullLink:
    return PullLink(a.pull_gbps * 1e9, a.pull_latency_ms / 1e3, a.kv_bytes_per_token)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(ap)
    ap.add_argument("--replicas", default="8,16,64")
    ap.add_argument("--policies", default=ALL)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--reference", action="store_true")
    ap.add_argument("--kv-tokens-per-replica", type=int, default=819_200)
    ap.add_argument("--cost-model", choices=sorted(COST_MODELS), default="smollm2-1core")
    ap.add_argument("--offered-load", type=float, default=None)
    ap.add_argument("--prefill-weight", type=float, default=None, help="override ScoringConfig.prefill_weight")
    add_link_args(ap)
    ap.add_argument("--tier-factor", type=float, default=4.0, help="NAME+tier: each tier holds F x the replica's KV")
    ap.add_argument("--tier-gbps", type=float, default=2.0, help="NAME+tier: the tier's reload bandwidth, GB/s")
    ap.add_argument("--tier-latency-ms", type=float, default=1.0, help="NAME+tier: set-up time per reload")
    a = ap.parse_args(argv)
    if a.format == "sessions" and a.session_rate is None and a.concurrency is None:
        a.concurrency = 4
    scoring = ScoringConfig() if a.prefill_weight is None else ScoringConfig(prefill_weight=a.prefill_weight)
    cost = COST_MODELS[a.cost_model]
    seeds = _ints(a.seeds) if a.format == "sessions" else [0]
    wls = {seed: workload(a, seed) for seed in seeds}
    runs = [(1, "kv")] if a.reference else []
    reference: list[dict] = []
    runs += [(n, p) for n in _ints(a.replicas) for p in a.policies.split(",")]
    tiered = any("tier" in policy_spec(p)[1] for _, p in runs)
    print("| replicas | policy | block hit rate | TTFT p50 | TTFT p99 | max/mean load | follow-ups home | "
          "speedup | mean busy | pulled |" + (" reloaded |" if tiered else "")
          + (" hit / one replica |" if a.reference else ""))
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|" if tiered else "") + ("---|" if a.reference else ""))
    link = pull_link(a)
    tier = TierSpec(a.tier_factor, PullLink(a.tier_gbps * 1e9, a.tier_latency_ms / 1e3, a.kv_bytes_per_token))
    for n, policy in runs:
        rows = []
        t0 = time.perf_counter()
        for seed in seeds:
            wl = wls[seed]
            s = speedup(wl, n if not (a.reference and n == 1) else _ints(a.replicas)[0], a.offered_load,
                        cost.prefill_token_s)
            name, extras = policy_spec(policy)
            cfg = SimConfig(n, name, cost.scaled(s), a.kv_tokens_per_replica, scoring,
                            pull=link if "pull" in extras else None, tier=tier if "tier" in extras else None)
            rows.append((Simulator(cfg, wl).run(), s))
        outs = [r for r, _ in rows]
        if a.reference and n == 1:
            reference = outs
        if a.reference:
            for o, ref in zip(outs, reference, strict=True):
                o["hit_over_reference"] = o["block_hit_rate"] / ref["block_hit_rate"]
        label = f"{n} (reference)" if a.reference and n == 1 else str(n)
        print(f"| {label} | {policy} | {agg(outs, 'block_hit_rate')} | {agg(outs, 'ttft_p50', '{:.2f}')} s | "
              f"{agg(outs, 'ttft_p99', '{:.1f}')} s | {agg(outs, 'max_over_mean_load', '{:.2f}')} | "
              f"{agg(outs, 'follow_ups_home')} | {rows[0][1]:.2f} | {agg(outs, 'mean_busy', '{:.2f}')} | "
              f"{agg(outs, 'pulled_blocks', '{:.0f}')} |"
              + (f" {agg(outs, 'tier_reloaded_blocks', '{:.0f}')} |" if tiered else "")
              + (f" {agg(outs, 'hit_over_reference')} |" if a.reference else ""), flush=True)
        print(f"<!-- {n} {policy}: {time.perf_counter() - t0:.0f} s -->", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

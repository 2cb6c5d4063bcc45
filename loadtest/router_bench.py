r"""Router benchmarks.

`policies`: the same seeded multi-turn + shared-system-prompt workload through each routing policy on a local
2-replica fleet; prints the fleet prefix-cache hit rate (from the engines' own /metrics), TTFT p50/p99 and
throughput per policy, and `kv`'s hit rate as a ratio of what ONE replica holding the whole fleet's cache
gets on the same workload (target >= 0.9), and round-robin's TTFT p50 over kv's.

    python -m loadtest.router_bench policies --sessions 32 --turns 4 --concurrency 4
    python -m loadtest.router_bench policies --engine-module loadtest.fake_engine --api tokens   # smoke, no model

Prefill-heavy (agent / document chats: each turn adds ~300 user + 100 reply tokens of history, so a follow-up
that misses its cache re-prefills 1-2k tokens; the longest prompt is ~2.2k tokens, well inside SmolLM2's 8192
and the default 1024 blocks x 16 tokens per replica), each replica pinned to its own core with one thread:

    python -m loadtest.router_bench policies --policies kv,round-robin --pin-cores --mean-user-tokens 300 \
        --reply-tokens 100 --max-tokens 16 --sessions 24 --turns 4 --concurrency 4

Each policy gets a fresh router and its own `cache_salt`, so it starts from caches that hold none of its
prompts (hashes are salted) without reloading the engines; the single-replica reference runs a separate
engine with twice the blocks.

`overhead`: the router's own cost against a fast fake engine: added latency per request (router vs direct,
p50/p99, sequential) and streamed requests/s one router process sustains (client processes separate).

    python -m loadtest.router_bench overhead --requests 2000 --duration 10 --concurrency 64 --client-procs 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time

import httpx

from kvfleet.workload import generate_trace, words
from loadtest.router_overhead import cmd_overhead, pct
from loadtest.router_procs import Proc, start_engine, start_router
from router.routing.replicas import parse_engine_metrics


# -- workload ------------------------------------------------------------------------------------------------
def build_sessions(ns) -> list[list[dict]]:
    """Seeded sessions: each opens with one of a few long shared system prompts, then `turns` turns that
    each resend the whole history. Returns per session its list of message lists."""
    trace = generate_trace(ns.sessions * ns.turns, seed=ns.seed, mode="multi_turn", turns_per_session=ns.turns,
                           mean_prompt_tokens=ns.mean_user_tokens, min_output_tokens=ns.max_tokens,
                           max_output_tokens=ns.max_tokens, reply_tokens=ns.reply_tokens)
    systems = [words(random.Random(f"{ns.seed}-sys-{k}"), ns.system_tokens) for k in range(ns.system_prompts)]
    sessions: dict[str, list[list[dict]]] = {}
    for req in trace:
        k = random.Random(f"{ns.seed}-{req.session_id}").randrange(ns.system_prompts)
        msgs = [{"role": "system", "content": systems[k]}, *[dict(m) for m in req.messages]]
        sessions.setdefault(req.session_id, []).append(msgs)
    return list(sessions.values())


def fleet_prefix_counters(urls: list[str]) -> tuple[float, float]:
    q = h = 0.0
    for u in urls:
        load = parse_engine_metrics(httpx.get(u + "/metrics", timeout=5).text)
        q, h = q + load.prefix_queries, h + load.prefix_hits
    return q, h


async def run_sessions(base_url: str, sessions, ns, salt: str, tokenizer) -> dict:
    """Closed loop: `concurrency` workers, each runs whole sessions turn after turn (streamed)."""
    queue: asyncio.Queue = asyncio.Queue()
    for i, s in enumerate(sessions):
        queue.put_nowait((i, s))
    ttfts, e2es, errors, out_tokens = [], [], [], 0
    trace: list[tuple] = []  # (session, turn, replica, prompt tokens, cached tokens, TTFT ms, start s)
    start = time.perf_counter()
    by_replica: dict[str, int] = {}

    async def one(client, sid, turn, msgs) -> None:
        nonlocal out_tokens
        body = {"model": ns.model, "max_tokens": ns.max_tokens, "stream": True, "temperature": 0,
                "stream_options": {"include_usage": True}, "cache_salt": salt}
        if ns.api == "tokens":
            path, body["prompt"] = "/v1/completions", tokenizer.apply_chat_template(msgs)
        else:
            path, body["messages"] = "/v1/chat/completions", msgs
        t0 = time.perf_counter()
        first = None
        async with client.stream("POST", base_url + path, json=body, headers={"x-session-id": f"s{sid}"}) as r:
            if r.status_code != 200:
                errors.append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                return
            rep = r.headers.get("x-kvfleet-replica", "direct")
            by_replica[rep] = by_replica.get(rep, 0) + 1
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    errors.append(chunk["error"].get("message", "error"))
                    return
                choices = chunk.get("choices") or []
                if first is None and choices and (choices[0].get("text") or
                                                  (choices[0].get("delta") or {}).get("content")):
                    first = time.perf_counter()  # the first generated text, not the role-only chunk
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    out_tokens += usage.get("completion_tokens", 0)
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    trace.append((sid, turn, rep, usage.get("prompt_tokens", 0), cached,
                                  round(((first or time.perf_counter()) - t0) * 1e3, 1), round(t0 - start, 3)))
        ttfts.append((first or time.perf_counter()) - t0)
        e2es.append(time.perf_counter() - t0)

    async def worker(client):
        while not queue.empty():
            sid, turns = queue.get_nowait()
            for turn, msgs in enumerate(turns):
                if turn and getattr(ns, "think_s", 0):
                    await asyncio.sleep(ns.think_s)  # the user reads the reply before the next turn
                await one(client, sid, turn, msgs)

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        await asyncio.gather(*(worker(client) for _ in range(ns.concurrency)))
    wall = time.perf_counter() - t0
    return {"requests": len(e2es), "errors": len(errors), "first_error": errors[0] if errors else None,
            "wall_s": wall, "req_per_s": len(e2es) / wall, "out_tok_per_s": out_tokens / wall,
            "ttft_p50_ms": pct(ttfts, 50) * 1e3, "ttft_p99_ms": pct(ttfts, 99) * 1e3,
            "e2e_p50_ms": pct(e2es, 50) * 1e3, "by_replica": by_replica,
            "usage_hit_rate": sum(t[4] for t in trace) / max(sum(t[3] for t in trace), 1),
            "follow_ups_home": _follow_ups_home(trace), "trace": sorted(trace)}


def _follow_ups_home(trace) -> float:
    """Fraction of follow-up turns served by the replica that served the session's previous turn."""
    prev = {}
    same = total = 0
    for sid, turn, rep, *_ in sorted(trace):
        if turn > 0 and (sid, turn - 1) in prev:
            total += 1
            same += prev[(sid, turn - 1)] == rep
        prev[(sid, turn)] = rep
    return same / total if total else float("nan")


def measure(base_url: str, engine_urls: list[str], sessions, ns, salt: str, tokenizer) -> dict:
    q0, h0 = fleet_prefix_counters(engine_urls)
    res = asyncio.run(run_sessions(base_url, sessions, ns, salt, tokenizer))
    time.sleep(0.3)
    q1, h1 = fleet_prefix_counters(engine_urls)
    res["hit_rate"] = (h1 - h0) / (q1 - q0) if q1 > q0 else float("nan")
    return res


def cmd_policies(ns) -> dict:
    log_dir = tempfile.mkdtemp(prefix="router-bench-")
    tokenizer = None
    if ns.api == "tokens":
        from engine.tokenizer import load_tokenizer
        tokenizer = load_tokenizer(ns.model)
    sessions = build_sessions(ns)
    longest = max(sum(len(m["content"].split()) + 4 for m in turns[-1]) for turns in sessions)
    print(f"workload: {len(sessions)} sessions x {ns.turns} turns, {ns.system_prompts} shared system prompts of "
          f"~{ns.system_tokens} tokens, longest prompt ~{longest} tokens, max_tokens {ns.max_tokens}, "
          f"concurrency {ns.concurrency}; logs {log_dir}")
    results: dict[str, dict] = {}
    procs: list[Proc] = []
    try:
        engines = [start_engine(ns, log_dir, f"replica-{i}", ns.num_blocks, i) for i in range(ns.replicas)]
        procs += engines
        for e in engines:
            e.wait_ready()
        urls = [e.url for e in engines]
        for run, policy in enumerate(ns.policies.split(",")):
            router = start_router(ns, log_dir, urls, policy, ns.model)
            procs.append(router)
            router.wait_ready()
            while httpx.get(router.url + "/ready").json().get("ready_replicas") != len(urls):
                time.sleep(0.1)
            time.sleep(1.0)  # KV event streams connected
            name = policy if policy not in results else f"{policy}#{run}"  # a policy may run twice
            results[name] = measure(router.url, urls, sessions, ns, f"bench-{ns.seed}-{run}-{policy}", tokenizer)
            router.stop()
            procs.remove(router)
            print_row(name, results[name])
        for e in engines:
            e.stop()
            procs.remove(e)
        if ns.single_reference:
            big = start_engine(ns, log_dir, "single-whole-cache", ns.num_blocks * ns.replicas)
            procs.append(big)
            big.wait_ready()
            results["single-replica-whole-cache"] = measure(big.url, [big.url], sessions, ns, f"bench-{ns.seed}-one",
                                                            tokenizer)
            print_row("single-replica-whole-cache", results["single-replica-whole-cache"])
    finally:
        for p in reversed(procs):  # routers first: engines then have no open event streams
            p.stop()
    summary = {}
    if "kv" in results and "single-replica-whole-cache" in results:
        summary["kv_hit_rate_vs_single_whole_cache"] = results["kv"]["hit_rate"] / \
            results["single-replica-whole-cache"]["hit_rate"]
    if "kv" in results and "round-robin" in results:
        summary["round_robin_ttft_p50_over_kv"] = results["round-robin"]["ttft_p50_ms"] / results["kv"]["ttft_p50_ms"]
        summary["kv_hit_rate_over_round_robin"] = results["kv"]["hit_rate"] / max(results["round-robin"]["hit_rate"],
                                                                                   1e-9)
    for k, v in summary.items():
        target = {"kv_hit_rate_vs_single_whole_cache": " (target >= 0.90)",
                  "round_robin_ttft_p50_over_kv": " (target: clearly > 1)"}.get(k, "")
        print(f"{k}: {v:.3f}{target}")
    return {"results": results, "summary": summary}


def print_row(name: str, r: dict) -> None:
    print(f"{name:28s} hit {r['hit_rate']:6.1%} (usage {r['usage_hit_rate']:6.1%}, follow-ups home "
          f"{r['follow_ups_home']:4.0%})  TTFT p50 {r['ttft_p50_ms']:8.1f} ms  p99 {r['ttft_p99_ms']:8.1f} ms"
          f"  {r['req_per_s']:6.2f} req/s  {r['out_tok_per_s']:7.1f} tok/s  errors {r['errors']}  "
          f"split {sorted(r['by_replica'].values())}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="router_bench", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("policies", help="hit rate / TTFT / throughput per routing policy on a local fleet")
    p.add_argument("--policies", default="kv,approx-prefix,session,round-robin,least-load")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--mean-user-tokens", type=float, default=60)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4, help="sessions in flight at once")
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per replica")
    p.add_argument("--reply-tokens", type=int, default=None,
                   help="words of each earlier assistant reply in the history (default: max-tokens // 2)")
    p.add_argument("--threads-per-engine", type=int, default=None,
                   help="torch threads per engine (default: all usable cores, 1 with --pin-cores)")
    p.add_argument("--pin-cores", action="store_true",
                   help="pin engine replica i to usable core i %% their count (the single-replica reference: the "
                        "first core)")
    p.add_argument("--no-single-reference", dest="single_reference", action="store_false",
                   help="skip the one-replica-with-the-whole-cache reference run")
    p.add_argument("--api", choices=("chat", "tokens"), default="chat",
                   help="chat messages (the router tokenizes) or token-id prompts via /v1/completions")
    p.add_argument("--engine-arg", action="append", default=[], help="extra engine flag (repeatable)")
    p.add_argument("--router-arg", action="append", default=[],
                   help="extra router flag (repeatable), e.g. --router-arg=--kv-token-cost=0")
    o = sub.add_parser("overhead", help="router latency overhead and streamed requests/s vs a fake engine")
    o.add_argument("--requests", type=int, default=1000, help="sequential requests per path for latency")
    o.add_argument("--duration", type=float, default=10.0, help="seconds of the throughput run")
    o.add_argument("--concurrency", type=int, default=64)
    o.add_argument("--client-procs", type=int, default=2)
    o.add_argument("--upstreams", type=int, default=2, help="fake engines behind the router")
    o.add_argument("--chunks", type=int, default=8, help="SSE chunks per streamed response")
    o.add_argument("--policy", default="kv")
    o.add_argument("--router-arg", action="append", default=[],
                   help="extra router flag (repeatable), e.g. --router-arg=--replica-slots=1000")
    for q in (p, o):
        q.add_argument("--model", default="smollm2")
        q.add_argument("--seed", type=int, default=0)
        q.add_argument("--engine-module", default=None, help="engine as `python -m MODULE` (e.g. loadtest.fake_engine)")
        q.add_argument("--json", default=None, help="write the figures to this file")
    ns = ap.parse_args(argv)
    if ns.cmd == "policies" and ns.reply_tokens is not None and ns.reply_tokens < 1:
        ap.error(f"--reply-tokens must be >= 1, got {ns.reply_tokens}")
    out = cmd_policies(ns) if ns.cmd == "policies" else cmd_overhead(ns)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

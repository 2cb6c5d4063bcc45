"""The lower KV tier on one real engine whose KV cache is too small for its conversations (issue 31).

    python -m loadtest.kv_tier_bench [--conversations 16] [--turns 6] [--num-blocks 256] [--rounds 2]

`--conversations` multi-turn chats (a shared system prompt, then each turn's question and the answer appended)
go turn by turn, `--concurrency` at a time, to one engine with `--num-blocks` KV blocks: their history does not
fit, so without a tier every later turn recomputes what was evicted. The same load runs against the same engine
without a tier and with a tier of `--tier-gib` on local disk, alternating, `--rounds` times each: prefix-cache hit
rate (engine counters), tokens reloaded from the tier, TTFT p50 / p99 and the load's wall time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import tempfile
import time

import httpx

from deploy.ports import free_port
from loadtest.router_procs import PY, Proc

WORDS = ("harbor ferry captain storm lantern compass tide anchor gull rope sail keel reef beacon island mist "
         "current chart voyage pier dune cliff wave").split()


def text(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 31 + i * 7 + i * i * seed) % len(WORDS)] for i in range(words))


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def turn(url: str, prompt: str, max_tokens: int) -> tuple[float, str]:
    t0 = time.perf_counter()
    first = None
    out = []
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                import json

                piece = json.loads(line[6:])["choices"][0].get("text", "")
                if piece and first is None:
                    first = time.perf_counter() - t0
                out.append(piece)
    return (first if first is not None else time.perf_counter() - t0), "".join(out)


def run_load(url: str, ns) -> dict:
    system = "You are a harbor master's assistant. " + text(1, 150)
    convs = [system + f"\nConversation {c}.\n" for c in range(ns.conversations)]
    q0, h0 = metric(url, "vllm:prefix_cache_queries_total"), metric(url, "vllm:prefix_cache_hits_total")
    r0 = metric(url, "kvfleet:kv_tier_reloaded_blocks_total")
    ttfts: list[float] = []
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(ns.concurrency) as pool:
        for t in range(ns.turns):
            prompts = [conv + f"User: {text(100 * t + c, 60)}\nAssistant:" for c, conv in enumerate(convs)]
            results = list(pool.map(lambda p: turn(url, p, ns.reply_tokens), prompts))
            for c, (ttft, reply) in enumerate(results):
                ttfts.append(ttft)
                convs[c] = prompts[c] + reply + "\n"
    wall = time.perf_counter() - t0
    queries = metric(url, "vllm:prefix_cache_queries_total") - q0
    hits = metric(url, "vllm:prefix_cache_hits_total") - h0
    ttfts.sort()
    return {"hit_rate": hits / queries if queries else 0.0, "reloaded_blocks": metric(
        url, "kvfleet:kv_tier_reloaded_blocks_total") - r0, "ttft_p50": statistics.median(ttfts),
            "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--reply-tokens", type=int, default=48)
    ap.add_argument("--num-blocks", type=int, default=256)
    ap.add_argument("--tier-gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ns = ap.parse_args(argv)
    log_dir = tempfile.mkdtemp(prefix="kv-tier-bench-")
    results: dict[str, list[dict]] = {"no tier": [], "disk tier": []}
    for i in range(ns.rounds):
        for mode in results:
            port = free_port()
            extra = ["--kv-tier-gib", str(ns.tier_gib), "--kv-tier-path", f"{log_dir}/tier"] if mode != "no tier" else []
            proc = Proc([PY, "-m", "kvfleet", "engine", "--model", "smollm2", "--dtype", ns.dtype, "--port", str(port),
                         "--num-blocks", str(ns.num_blocks), "--max-num-seqs", str(ns.concurrency), "--log-level",
                         "warning", *extra], f"http://127.0.0.1:{port}", log_dir, f"engine-{mode}-{i}".replace(" ", "-"))
            try:
                proc.wait_ready()
                res = run_load(proc.url, ns)
            finally:
                proc.stop()
            results[mode].append(res)
            print(f"round {i} {mode:9}: hit rate {res['hit_rate']:.3f}, reloaded {res['reloaded_blocks']:.0f} blocks, "
                  f"TTFT p50 {res['ttft_p50']:.3f} s p99 {res['ttft_p99']:.3f} s, {res['wall_s']:.1f} s")
    print(f"\n{ns.conversations} conversations x {ns.turns} turns, KV cache of {ns.num_blocks} blocks:")
    for mode, runs in results.items():
        print(f"  {mode:9}: hit rate {statistics.mean(r['hit_rate'] for r in runs):.3f}, TTFT p50 "
              f"{statistics.mean(r['ttft_p50'] for r in runs):.3f} s p99 {statistics.mean(r['ttft_p99'] for r in runs):.3f}"
              f" s, wall {statistics.mean(r['wall_s'] for r in runs):.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

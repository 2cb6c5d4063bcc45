"""Prefill/decode disaggregation against colocation on this machine (issue 31).

    python -m loadtest.disagg_bench [--requests 32] [--rate 0.5] [--rounds 2]

Two engines (one thread each) behind a router, once colocated (both serve whole requests, `kv` policy) and once
disaggregated (a pools file: engine A `role: prefill`, engine B `role: decode`; B pulls each prompt's KV from A).
The same seeded trace for both, alternating, `--rounds` times: Poisson arrivals at `--rate` requests/s, prompts
of 300-1,500 tokens (a new one each), `--output-tokens` streamed tokens each. Prints TTFT and TPOT p50/p99 (from
the client) and output tokens/s.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import statistics
import tempfile
import time

import httpx

from deploy.ports import free_port
from loadtest.kv_transfer_bench import engine, metric, text
from loadtest.router_procs import PY, Proc


def router(log_dir: str, name: str, a: str, b: str, disagg: bool) -> Proc:
    port = free_port()
    if disagg:
        path = os.path.join(log_dir, f"{name}.yaml")
        with open(path, "w") as f:
            f.write(f"""pools:
  pre: {{version: "v1", weight: 1, role: prefill, model: smollm2, engine: kvfleet, replicas: ["{a}"]}}
  dec: {{version: "v1", weight: 1, role: decode, model: smollm2, engine: kvfleet, replicas: ["{b}"]}}
""")
        where = ["--pools", path]
    else:
        where = ["--replicas", f"{a},{b}"]
    return Proc([PY, "-m", "router.main", "--port", str(port), "--policy", "kv", "--model", "smollm2",
                 "--default-model", "smollm2", "--health-interval", "0.2", "--scrape-interval", "0.2",
                 "--log-level", "warning", *where], f"http://127.0.0.1:{port}", log_dir, name)


def one(url: str, prompt: str, out_tokens: int) -> dict:
    t0 = time.perf_counter()
    stamps: list[float] = []
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": out_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                stamps.append(time.perf_counter() - t0)
    ttft = stamps[0] if stamps else time.perf_counter() - t0
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0
    return {"ttft": ttft, "tpot": tpot, "tokens": len(stamps)}


def run_trace(url: str, ns, seed: int) -> dict:
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for i in range(ns.requests):
        t += rng.expovariate(ns.rate)
        arrivals.append((t, f"Request {seed}-{i}: " + text(seed * 1000 + i, rng.randint(280, 1400))))
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(ns.requests) as pool:
        def later(at: float, prompt: str) -> dict:
            time.sleep(max(0.0, at - (time.perf_counter() - t0)))
            return one(url, prompt, ns.output_tokens)
        results = list(pool.map(lambda a: later(*a), arrivals))
    wall = time.perf_counter() - t0
    ttft = sorted(r["ttft"] for r in results)
    tpot = sorted(r["tpot"] for r in results)
    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
    return {"ttft_p50": statistics.median(ttft), "ttft_p99": q(ttft, 0.99), "tpot_p50": statistics.median(tpot),
            "tpot_p99": q(tpot, 0.99), "tok_s": sum(r["tokens"] for r in results) / wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=0.5, help="arrivals per second (Poisson)")
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ns = ap.parse_args(argv)
    log_dir = tempfile.mkdtemp(prefix="disagg-bench-")
    a, b = engine(log_dir, "a", ns.dtype), engine(log_dir, "b", ns.dtype)
    results: dict[str, list[dict]] = {"colocated": [], "disaggregated": []}
    try:
        a.wait_ready()
        b.wait_ready()
        for i in range(ns.rounds):
            for mode in results:
                r = router(log_dir, f"router-{mode}-{i}", a.url, b.url, mode == "disaggregated")
                try:
                    r.wait_ready(timeout=60)
                    deadline = time.monotonic() + 30
                    while metric(r.url, "kvfleet_router_kv_events_live") < 2 and time.monotonic() < deadline:
                        time.sleep(0.2)
                    res = run_trace(r.url, ns, seed=100 + i)  # the same trace for both modes of a round
                finally:
                    r.stop()
                results[mode].append(res)
                print(f"round {i} {mode:13}: TTFT p50 {res['ttft_p50']:.2f} s p99 {res['ttft_p99']:.2f} s, TPOT p50 "
                      f"{1000 * res['tpot_p50']:.1f} ms p99 {1000 * res['tpot_p99']:.1f} ms, {res['tok_s']:.1f} tok/s")
    finally:
        a.stop()
        b.stop()
    print(f"\n{ns.requests} requests at {ns.rate}/s, {ns.output_tokens} output tokens, two engines of one thread:")
    for mode, runs in results.items():
        m = {k: statistics.mean(r[k] for r in runs) for k in runs[0]}
        print(f"  {mode:13}: TTFT p50 {m['ttft_p50']:.2f} s p99 {m['ttft_p99']:.2f} s, TPOT p50 "
              f"{1000 * m['tpot_p50']:.1f} ms p99 {1000 * m['tpot_p99']:.1f} ms, {m['tok_s']:.1f} output tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

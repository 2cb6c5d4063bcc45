"""KV that moves (issue 31), measured on real engines over loopback.

    python -m loadtest.kv_transfer_bench [--dtype bfloat16] [--bursts 3] [--burst-tokens 2000]

1. Transfer cost: a prompt of 1k / 2k / 4k tokens computed on engine A, then pulled by engine B (the pull
   header, as a router sends it): MB/s and ms per 1,000 tokens of the pull against A's measured prefill of the
   same tokens; their ratio is the `--pull-token-cost` to give the router.
2. Shared-prefix bursts through the router over A and B: `--burst-size` parallel requests on a new system
   prompt of `--burst-tokens` tokens (each with its own question), repeated `--bursts` times with new prompts,
   alternating the same burst sent straight to engine A ("one": what one engine computes for it), a router
   without pulls and one with them (same engines): prompt tokens the fleet computed against one prompt and
   against one engine, each replica's share of the requests, TTFT p50 / p99, and how the pulls ended.
   With --auto, a third router takes its turn in each round: the router's defaults (`--pull-token-cost auto`),
   one router for all its bursts (it learns the cost from the engines' counters as they go; its final estimate
   is printed).

Each engine runs on one thread (two replicas on this machine's two cores). Nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import tempfile
import time

import httpx

from contract.kv_transfer import PULL_HEADER
from deploy.ports import free_port
from loadtest.router_procs import PY, Proc

WORDS = ("harbor ferry captain storm lantern compass tide anchor gull rope sail keel reef beacon island mist "
         "current chart voyage pier dune cliff wave").split()


def text(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 31 + i * 7 + i * i * seed) % len(WORDS)] for i in range(words))


def engine(log_dir: str, name: str, dtype: str) -> Proc:
    port = free_port()
    return Proc([PY, "-m", "kvfleet", "engine", "--model", "smollm2", "--dtype", dtype, "--port", str(port),
                 "--instance-id", name, "--num-threads", "1", "--num-blocks", "4096", "--max-num-seqs", "16",
                 "--kv-pull-timeout", "60", "--log-level", "warning"], f"http://127.0.0.1:{port}", log_dir, name)


def router(log_dir: str, name: str, replicas: list[str], pull_cost: float | str, fixed: float) -> Proc:
    """pull_cost: 0 (no pulls), a cost in prefill tokens, or "auto" (the router's defaults: measured from the
    engines)."""
    port = free_port()
    extra = ([] if pull_cost == "auto" else ["--pull-token-cost", "0"] if pull_cost == 0 else
             ["--pull-token-cost", str(pull_cost), "--pull-fixed-tokens", str(fixed)])
    return Proc([PY, "-m", "router.main", "--port", str(port), "--policy", "kv", "--model", "smollm2",
                 "--default-model", "smollm2", "--replicas", ",".join(replicas), "--health-interval", "0.2",
                 "--scrape-interval", "0.2", "--log-level", "warning", *extra], f"http://127.0.0.1:{port}",
                log_dir, name)


def metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def complete(url: str, prompt: str, headers: dict | None = None, max_tokens: int = 1) -> tuple[dict, float]:
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json={"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0}, headers=headers or {}, timeout=600)
    r.raise_for_status()
    return r.json(), time.perf_counter() - t0


def transfer_cost(a: Proc, b: Proc, sizes: list[int]) -> list[dict]:
    rows = []
    for n in sizes:
        prompt = text(n, int(n * 0.95))  # about n tokens
        complete(a.url, "warm " + text(1, 20))
        body, prefill_s = complete(a.url, prompt)
        tokens = body["usage"]["prompt_tokens"]
        s0, c0, b0 = (metric(b.url, "kvfleet:kv_pull_seconds_sum"), metric(b.url, "kvfleet:kv_pull_seconds_count"),
                      metric(b.url, "kvfleet:kv_transfer_bytes_total", direction="import"))
        got, total_s = complete(b.url, prompt, {PULL_HEADER: a.url})
        pull_s = metric(b.url, "kvfleet:kv_pull_seconds_sum") - s0
        assert metric(b.url, "kvfleet:kv_pull_seconds_count") - c0 == 1
        mb = (metric(b.url, "kvfleet:kv_transfer_bytes_total", direction="import") - b0) / 1e6
        pulled = got["usage"]["prompt_tokens_details"]["cached_tokens"]
        rows.append({"tokens": tokens, "pulled": pulled, "MB": round(mb, 1), "pull_s": round(pull_s, 3),
                     "MB/s": round(mb / pull_s, 1), "pull ms/1k": round(1000 * pull_s / pulled * 1000, 1),
                     "prefill_s": round(prefill_s, 3), "prefill ms/1k": round(1000 * prefill_s / tokens * 1000, 1),
                     "cost": round(pull_s / pulled / (prefill_s / tokens), 4), "B total_s": round(total_s, 3)})
    return rows


def pull_outcomes(*engines: Proc) -> dict[str, float]:
    """kvfleet:kv_pulls_total by outcome, summed over the engines."""
    out: dict[str, float] = {}
    for e in engines:
        for line in httpx.get(e.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("kvfleet:kv_pulls_total{"):
                outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
                out[outcome] = out.get(outcome, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def rates(*engines: Proc) -> dict[str, float]:
    """The counters --pull-token-cost auto reads, summed over the engines."""
    names = {"kvfleet:kv_pull_transfer_seconds_total": "pull_s", "kvfleet:kv_pulled_tokens_total": "pulled",
             "kvfleet:prefill_seconds_total": "prefill_s", "kvfleet:prefill_computed_tokens_total": "prefilled"}
    return {short: sum(metric(e.url, name) for e in engines) for name, short in names.items()}


def ttft(url: str, prompt: str) -> tuple[str, float, int, int]:
    t0 = time.perf_counter()
    first = None
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    computed = prompt_tokens = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        replica = r.headers.get("x-kvfleet-replica", url)  # (an engine asked directly names no replica)
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and '"text":"' in line and '"text":""' not in line:
                first = time.perf_counter() - t0
            if '"usage":{' in line and '"prompt_tokens"' in line:
                import json

                u = json.loads(line[6:])["usage"]
                prompt_tokens = u["prompt_tokens"]
                computed = prompt_tokens - ((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return replica, first if first is not None else time.perf_counter() - t0, computed, prompt_tokens


def burst(r: Proc, seed: int, size: int, tokens: int) -> dict:
    system = f"System {seed}: " + text(seed, int(tokens * 0.95))
    prompts = [system + f"\nQuestion {i}: " + text(seed * 100 + i, 12) + "\nAnswer:" for i in range(size)]
    with concurrent.futures.ThreadPoolExecutor(size) as pool:
        got = list(pool.map(lambda p: ttft(r.url, p), prompts))
    return {"replicas": [g[0] for g in got], "ttft": [g[1] for g in got], "computed": sum(g[2] for g in got),
            "prompt": statistics.mean(g[3] for g in got)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sizes", default="1000,2000,4000")
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--burst-size", type=int, default=8)
    ap.add_argument("--burst-tokens", type=int, default=2000)
    ap.add_argument("--pull-token-cost", type=float, default=None,
                    help="skip the transfer measurement and route the bursts with this cost")
    ap.add_argument("--pull-fixed-tokens", type=float, default=64.0)
    ap.add_argument("--auto", action="store_true", help="also route bursts with --pull-token-cost auto")
    ns = ap.parse_args(argv)
    log_dir = tempfile.mkdtemp(prefix="kv-transfer-bench-")
    procs: list[Proc] = []
    try:
        a, b = engine(log_dir, "a", ns.dtype), engine(log_dir, "b", ns.dtype)
        procs += [a, b]
        a.wait_ready()
        b.wait_ready()
        cost, fixed = ns.pull_token_cost, ns.pull_fixed_tokens
        if cost is None:
            rows = transfer_cost(a, b, [int(x) for x in ns.sizes.split(",")])
            print("transfer cost (pull over loopback vs prefill on one thread):")
            for row in rows:
                print("  " + "  ".join(f"{k} {v}" for k, v in row.items()))
            # pull seconds = fixed + per token, fitted on the smallest and largest; in prefill tokens of the largest
            lo, hi = rows[0], rows[-1]
            per_token_s = (hi["pull_s"] - lo["pull_s"]) / (hi["pulled"] - lo["pulled"])
            prefill_token_s = hi["prefill_s"] / hi["tokens"]
            cost = round(max(per_token_s, 1e-6) / prefill_token_s, 4)
            fixed = round(max(lo["pull_s"] - per_token_s * lo["pulled"], 0.0) / prefill_token_s, 1)
            print(f"--pull-token-cost {cost} --pull-fixed-tokens {fixed} (a pull's seconds per token and per pull, "
                  f"in prefill tokens of a {hi['tokens']}-token prompt)")
        # "one": the burst sent straight to engine A, what one engine computes for it (the baseline)
        modes = ("one", "off", "on", "auto") if ns.auto else ("one", "off", "on")
        results: dict[str, list[dict]] = {m: [] for m in modes}
        auto_router: Proc | None = None
        for i in range(ns.bursts):
            for k, mode in enumerate(modes):
                if mode == "one":
                    r = a
                elif mode == "auto" and auto_router is not None:
                    r = auto_router
                else:
                    r = router(log_dir, f"router-{mode}-{i}", [a.url, b.url],
                               {"off": 0.0, "on": cost, "auto": "auto"}[mode], fixed)
                    procs.append(r)
                    r.wait_ready(timeout=60)
                    deadline = time.monotonic() + 30
                    while metric(r.url, "kvfleet_router_kv_events_live") < 2 and time.monotonic() < deadline:
                        time.sleep(0.2)
                before, rates0 = pull_outcomes(a, b), rates(a, b)
                res = burst(r, 1000 + len(modes) * i + k, ns.burst_size, ns.burst_tokens)
                after, rates1 = pull_outcomes(a, b), rates(a, b)
                d = {k_: rates1[k_] - rates0[k_] for k_ in rates0}
                if d["pulled"] and d["prefilled"]:  # what --pull-token-cost auto learns from this burst
                    res["burst_cost"] = (d["pull_s"] / d["pulled"]) / (d["prefill_s"] / d["prefilled"])
                res["pulls"] = {o: int(after[o] - before.get(o, 0)) for o in after if after[o] > before.get(o, 0)}
                if mode == "auto":
                    auto_router = r
                    res["cost"] = metric(r.url, "kvfleet_router_pull_token_cost")
                elif mode != "one":
                    r.stop()
                    procs.remove(r)
                results[mode].append(res)
                shares = [res["replicas"].count(u) for u in (a.url, b.url)]
                learned = f", pull cost now {res['cost']:.4f}" if "cost" in res else ""
                pulls = f", pulls {res['pulls']}" if res["pulls"] else ""
                if "burst_cost" in res:
                    pulls += f", measured pull cost {res['burst_cost']:.3f}"
                print(f"burst {i} pulls {mode:4}: computed {res['computed']} tokens, split {shares}, TTFT p50 "
                      f"{statistics.median(res['ttft']):.2f} s max {max(res['ttft']):.2f} s{learned}{pulls}")
        if ns.bursts:
            print(f"\nsummary (per burst of {ns.burst_size} requests on a new ~{ns.burst_tokens}-token prompt):")
            one = statistics.mean(r_["computed"] for r_ in results["one"])
        for mode in modes if ns.bursts else ():
            runs = results[mode]
            ttfts = sorted(t for r_ in runs for t in r_["ttft"])
            computed = statistics.mean(r_["computed"] for r_ in runs)
            single = statistics.mean(r_["prompt"] for r_ in runs)  # one prompt's tokens
            top = max(max(r_["replicas"].count(u) for u in (a.url, b.url)) / ns.burst_size for r_ in runs)
            p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]
            print(f"  pulls {mode:4}: fleet computed {computed:.0f} prompt tokens per burst "
                  f"({computed / single:.2f}x one prompt, {computed / one:.2f}x one engine), busiest replica "
                  f"{top:.0%} of requests, TTFT p50 {statistics.median(ttfts):.2f} s p99 {p99:.2f} s")
        return 0
    finally:
        for p in procs:
            p.stop()


if __name__ == "__main__":
    raise SystemExit(main())

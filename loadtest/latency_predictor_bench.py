"""The router's TTFT and TPOT models on a live fleet (issue 46): how far their predictions are from the streams it
sees.

Two real engines of the bundled model behind one `kv` router at default flags. Streamed chat requests with mixed
prompt lengths (short questions, and ~300- and ~1,000-word documents, each new, so most of each prompt is computed)
arrive open-loop at `--rate` requests/s for `--duration` seconds after a warm-up of `--warmup` requests (each model
needs 16 observations before it predicts). Prints the router's own figures for each model: how many requests had a
prediction, the median and p90 of |observed - predicted| / observed (from kvfleet_router_{ttft,tpot}_prediction_
relative_error, by linear interpolation inside its buckets) against the issue's targets (TTFT 0.20, TPOT 0.15),
and the median signed error.

    python -m loadtest.latency_predictor_bench --rate 2 --duration 90 [--max-tokens 16,128]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time

import httpx

from kvfleet.workload import words
from loadtest.router_procs import Proc, start_kv_fleet


def histogram(text: str, name: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of a Prometheus histogram in exposition text, in bucket order."""
    out = []
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    return sorted(out)


def quantile(buckets: list[tuple[float, float]], q: float, low: float = 0.0) -> float | None:
    """The q-quantile by linear interpolation inside the bucket that holds it (histogram_quantile's rule)."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank, prev_le, prev_n = q * total, low, 0.0
    for le, n in buckets:
        if n >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_n) / max(n - prev_n, 1e-12)
        prev_le, prev_n = le, n
    return prev_le


def report(what: str, target: float, low: float, before: str, after: str) -> None:
    name = f"kvfleet_router_{what}_prediction"

    def delta(suffix: str) -> list[tuple[float, float]]:
        return [(le, a - b) for (le, a), (_, b) in zip(histogram(after, name + suffix), histogram(before, name + suffix),
                                                       strict=True)]

    rel, signed = delta("_relative_error"), delta("_error_seconds")
    predicted = rel[-1][1] if rel else 0
    med, p90 = quantile(rel, 0.5), quantile(rel, 0.9)
    if med is None:
        print(f"{what.upper()}: no predictions")
        return
    print(f"{what.upper()}: {predicted:.0f} requests with a prediction; |observed - predicted| / observed: median "
          f"{med:.3f}, p90 {p90:.3f} (target: median <= {target:.2f}: {'met' if med <= target else 'MISSED'})")
    s_med = quantile(signed, 0.5, low=low)
    if s_med is not None:
        print(f"{what.upper()}: observed - predicted: median {s_med * 1000:+.1f} ms")


async def drive(url: str, rate: float, n: int, rng: random.Random, max_tokens: tuple[int, int]) -> int:
    done = 0

    async def one(c: httpx.AsyncClient) -> None:
        nonlocal done
        kind = rng.random()
        doc = words(rng, 1000) if kind < 0.2 else words(rng, 300) if kind < 0.5 else ""
        body = {"model": "smollm2", "max_tokens": rng.randint(*max_tokens), "stream": True, "temperature": 0,
                "messages": [{"role": "user", "content": f"{doc}\nQuestion: {words(rng, 10)}?"}]}
        async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
            async for _ in r.aiter_bytes():
                pass
        done += 1

    async with httpx.AsyncClient(timeout=600) as c:
        tasks = []
        for _ in range(n):
            tasks.append(asyncio.create_task(one(c)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=2.0, help="requests per second, open loop")
    p.add_argument("--duration", type=float, default=90.0)
    p.add_argument("--warmup", type=int, default=24)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-tokens", default="16", help="each request's max_tokens: N, or LO,HI drawn uniformly")
    ns = p.parse_args(argv)
    bounds = [int(x) for x in ns.max_tokens.split(",")]
    if not 1 <= len(bounds) <= 2 or min(bounds) < 1:
        p.error(f"--max-tokens: N or LO,HI (positive integers), got {ns.max_tokens!r}")
    max_tokens = (bounds[0], bounds[-1])
    ns.model, ns.engine_module, ns.engine_arg, ns.threads_per_engine, ns.pin_cores = "smollm2", None, [], 1, True
    log_dir = tempfile.mkdtemp(prefix="latency_predictor_bench_")
    procs: list[Proc] = []
    rng = random.Random(ns.seed)
    try:
        router = start_kv_fleet(ns, log_dir, procs)
        asyncio.run(drive(router.url, ns.rate, ns.warmup, rng, max_tokens))
        before = httpx.get(router.url + "/metrics").text
        t0 = time.monotonic()
        n = asyncio.run(drive(router.url, ns.rate, int(ns.rate * ns.duration), rng, max_tokens))
        after = httpx.get(router.url + "/metrics").text
        print(f"{n} streamed requests in {time.monotonic() - t0:.0f} s at {ns.rate}/s (two engines, kv router, "
              f"default flags, max_tokens {ns.max_tokens})")
        for what, target, low in (("ttft", 0.20, -5.0), ("tpot", 0.15, -0.2)):
            report(what, target, low, before, after)
        return 0
    finally:
        for proc in reversed(procs):
            proc.stop()


if __name__ == "__main__":
    sys.exit(main())

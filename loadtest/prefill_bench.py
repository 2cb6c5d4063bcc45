"""Prefill speed of single long prompts: TTFT and prompt tokens/s for 1k, 4k and 8k-token prompts, side by side.

    python -m loadtest.prefill_bench --with-kvfleet --with-vllm --rounds 2
    python -m loadtest.prefill_bench --target kvfleet=http://127.0.0.1:8001 --lengths 1000 4000

Each prompt is random token ids of the given length sent alone (c=1) to /v1/completions with max_tokens 1,
so TTFT is the prefill; every prompt is new (its own random ids), so no prefix cache helps either server.
Each length runs `--repeats` times after one unmeasured warm-up of that length; the median is reported.
Servers run one at a time (`--with-kvfleet`, `--with-vllm`, `--start`), alternating over `--rounds`, and the
first target is compared with the others as a ratio of prompt tokens/s (higher is better for the first).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time

import httpx

from loadtest.http_bench import add_target_args, resolve_targets, turns

MAX_MODEL_LEN = 8192


async def one(client: httpx.AsyncClient, url: str, model: str, ids: list[int]) -> float:
    t0 = time.perf_counter()
    r = await client.post(f"{url}/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 1,
                                                          "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t0


async def amain(a: argparse.Namespace) -> dict[tuple[str, int], list[float]]:
    targets, starts = resolve_targets(a, MAX_MODEL_LEN)
    rng = random.Random(a.seed)
    results: dict[tuple[str, int], list[float]] = {}
    async with httpx.AsyncClient(timeout=600) as client:
        for turn, url in turns(targets, starts, a.rounds, a.start_timeout, "prefill_bench"):
            name = turn.name.split("#")[0]
            async with turn:
                for n in a.lengths:
                    await one(client, url, a.model, [rng.randrange(100, 40000) for _ in range(n)])  # warm-up
                    for _ in range(a.repeats):
                        t = await one(client, url, a.model, [rng.randrange(100, 40000) for _ in range(n)])
                        results.setdefault((name, n), []).append(t)
                    med = statistics.median(results[(name, n)][-a.repeats:])
                    print(f"{turn.name:>12}  {n:5d} tokens  TTFT {med * 1000:8.1f} ms  {n / med:8.0f} prompt tok/s",
                          flush=True)
    print("\nmedian over all rounds")
    names = list(targets)
    for n in a.lengths:
        row = {name: statistics.median(results[(name, n)]) for name in names}
        line = "  ".join(f"{name} TTFT {t * 1000:.1f} ms ({n / t:.0f} tok/s)" for name, t in row.items())
        ratios = "  ".join(f"{names[0]}/{o} {row[o] / row[names[0]]:.2f}x" for o in names[1:])
        print(f"{n:5d} tokens: {line}  {ratios}")
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_args(ap)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1000, 4000, 8000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    a = ap.parse_args(argv)
    if max(a.lengths) >= MAX_MODEL_LEN:
        ap.error(f"--lengths must stay below {MAX_MODEL_LEN} (the servers' --max-model-len)")
    asyncio.run(amain(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())

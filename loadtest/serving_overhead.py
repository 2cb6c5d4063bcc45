"""What serving costs over the bare decode step: time per output token through HTTP against the offline step.

    python -m loadtest.serving_overhead                         # c=16 and 64; core process and core thread
    python -m loadtest.serving_overhead --concurrency 16 --cores process

First the offline decode step (`loadtest.decode_step`, fused CPU kernels, bf16) at each batch size, in its own
process; then, per engine core mode, a `kvfleet engine --engine-core MODE` serving the seeded chat trace of
`loadtest.http_bench` at the same concurrency. Prints served TPOT p50 over the offline step at that batch (the
target: at most 1.15; whatever is above 1 is the host work the server adds: HTTP, SSE, scheduling around it).
Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys

from kvfleet.workload import generate_trace
from loadtest.http_bench import KVFLEET_CMD, print_table, run_level, turns

TARGET = 1.15


def offline_steps(batches: list[int], context: int, steps: int) -> dict[int, float]:
    env = {**os.environ, "KVFLEET_CPU_KERNELS": "auto", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "loadtest.decode_step", "--child", "--batch-sizes",
                          ",".join(map(str, batches)), "--steps", str(steps), "--context", str(context)],
                         env=env, capture_output=True, text=True, check=True)
    return {r["batch"]: r["ms_per_step"] / 1e3 for r in json.loads(out.stdout.strip().splitlines()[-1])}


async def served(cores: list[str], concurrency: list[int], num_requests: int, seed: int, extra: str) -> list:
    trace = generate_trace(max(num_requests, 2 * max(concurrency)), seed, "single", max_output_tokens=128,
                           min_output_tokens=16)
    targets = {f"core-{m}": "http://127.0.0.1:8001" for m in cores}
    starts = {f"core-{m}": f"{KVFLEET_CMD} --max-model-len 2048 --engine-core {m} {extra}".strip() for m in cores}
    results = []
    for turn, url in turns(targets, starts, 1, 600, "serving_overhead"):
        async with turn:
            for c in concurrency:
                r = await run_level(url, "smollm2", trace[:max(num_requests, 2 * c)], c, turn.name, 0.0, 600)
                print_table([r])
                results.append(r)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--cores", nargs="+", choices=("process", "thread"), default=["process", "thread"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--context", type=int, default=200, help="KV tokens per sequence in the offline step")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kvfleet-args", default="", help="extra flags for the served engine")
    a = ap.parse_args(argv)
    step = offline_steps(a.concurrency, a.context, a.steps)
    for b, s in step.items():
        print(f"offline decode step, batch {b}: {s * 1e3:.1f} ms ({b / s:.0f} tok/s)", flush=True)
    results = asyncio.run(served(a.cores, a.concurrency, a.num_requests, a.seed, a.kvfleet_args))
    print(f"\nserved TPOT p50 over the offline step at the same batch (target <= {TARGET})")
    ok = True
    for r in results:
        ratio = r.tpot_p50 / step[r.concurrency]
        ok &= r.failed == 0
        print(f"  {r.target:<13} c={r.concurrency:<3} TPOT p50 {r.tpot_p50 * 1e3:6.1f} ms / step "
              f"{step[r.concurrency] * 1e3:5.1f} ms = x{ratio:.2f}  ({r.output_tok_s:.0f} out tok/s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

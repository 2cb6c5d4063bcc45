"""Goodput with latency targets on a live fleet (issue 46): an interactive class with TTFT and TPOT targets beside
a batch class without, the request rate raised step by step.

Two real engines of the bundled model (one thread each) behind one `kv` router, all at default flags. Each step
sends open-loop arrivals at `rate` requests/s for `--duration` seconds: a `--batch-share` of them batch requests
(a new ~1,000-word document, `max_tokens` 64, no targets), the others interactive (a short question, or one about
a new ~300-word document, `max_tokens` 32, streamed). Every step runs twice, in turn (the order swapped each step):
- `kv`: no targets on any request: kvfleet's placement before targets (the `kv` cost);
- `slo`: the interactive requests carry `x-llm-d-slo-ttft-ms` / `x-llm-d-slo-tpot-ms`: the router places them on
  replicas predicted to meet both, refuses with 429 what none is predicted to meet, and the engines size their
  steps for them.
Per step and mode: the interactive attainment (the share of those sent that were served with TTFT and TPOT within
the targets; a refusal or an error is a miss), their TTFT and TPOT p90, and the batch class's output tokens/s;
for `slo`, how far the router's TTFT and TPOT predictions were from what the streams saw, and the replicas the
router says the pool needs for the targets (kvfleet_router_pool_desired_replicas: its last minute, that step and
the one before it; two engines serve).
Goodput (DistServe): the highest rate whose attainment is at least `--goal`. The summary gives each mode's goodput,
their ratio (the issue's target: slo at least 1.5x kv) and the batch throughput ratio per step (target: at least
0.8x).

    python -m loadtest.slo_goodput_bench [--rates 1.5,2,2.5,3] [--duration 30] [--ttft-ms 1500 --tpot-ms 100]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx

from kvfleet.workload import words
from loadtest.latency_predictor_bench import report
from loadtest.router_procs import Proc, start_kv_fleet


@dataclass
class Outcome:
    interactive: bool
    status: int
    ttft_s: float | None = None
    tpot_s: float | None = None
    output_tokens: int = 0


async def one(c: httpx.AsyncClient, url: str, rng: random.Random, interactive: bool,
              targets: tuple[float, float] | None, run: str) -> Outcome:
    if interactive:
        doc = words(rng, 300) if rng.random() < 0.5 else ""
        max_tokens = 32
    else:
        doc, max_tokens = words(rng, 1000), 64
    body = {"model": "smollm2", "max_tokens": max_tokens, "stream": True, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"({run}) {doc}\nQuestion: {words(rng, 10)}?"}]}
    headers = {}
    if targets is not None and interactive:
        headers = {"x-llm-d-slo-ttft-ms": f"{targets[0] * 1000:g}", "x-llm-d-slo-tpot-ms": f"{targets[1] * 1000:g}"}
    t0 = time.monotonic()
    first = last = None
    tokens = 0
    try:
        async with c.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return Outcome(interactive, r.status_code)
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if any(ch.get("delta", {}).get("content") for ch in chunk.get("choices", [])):
                    last = time.monotonic()
                    first = first or last
    except httpx.HTTPError:
        return Outcome(interactive, 599)
    if first is None:
        return Outcome(interactive, 200, output_tokens=tokens)
    tpot = (last - first) / (tokens - 1) if tokens > 1 else 0.0
    return Outcome(interactive, 200, first - t0, tpot, tokens)


async def step(url: str, rate: float, duration: float, batch_share: float, seed: int,
               targets: tuple[float, float] | None, run: str) -> tuple[list[Outcome], float]:
    """One step's arrivals (the same times, classes and lengths for a seed, whatever the mode; the prompts start
    with `run`, so that no mode finds another's in the cache); (outcomes, seconds until the last finished)."""
    rng = random.Random(seed)
    arrivals, t = [], rng.expovariate(rate)
    while t < duration:
        arrivals.append((t, rng.random() >= batch_share, random.Random(rng.random())))
        t += rng.expovariate(rate)
    async with httpx.AsyncClient(timeout=180) as c:
        t0 = time.monotonic()
        tasks = []
        for at, interactive, req_rng in arrivals:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            tasks.append(asyncio.create_task(one(c, url, req_rng, interactive, targets, run)))
        out = await asyncio.gather(*tasks)
    return list(out), time.monotonic() - t0


def p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))] if xs else float("nan")


def summarize(out: list[Outcome], seconds: float, ttft: float, tpot: float) -> dict:
    inter = [o for o in out if o.interactive]
    served = [o for o in inter if o.status == 200 and o.ttft_s is not None]
    met = [o for o in served if o.ttft_s <= ttft and o.tpot_s <= tpot]
    batch = [o for o in out if not o.interactive and o.status == 200]
    return {"sent": len(inter), "refused": sum(o.status == 429 for o in inter),
            "errors": sum(o.status not in (200, 429) for o in out),
            "attainment": len(met) / len(inter) if inter else 1.0,
            "ttft_p90": p90([o.ttft_s for o in served]), "tpot_p90": p90([o.tpot_s for o in served]),
            "batch_tok_s": sum(o.output_tokens for o in batch) / seconds, "batch": len(batch)}


def goodput(rows: list[tuple[float, dict]], goal: float) -> float:
    """The highest rate whose attainment is at least `goal` (0 when none is)."""
    return max((rate for rate, s in rows if s["attainment"] >= goal), default=0.0)


def desired_replicas(metrics: str) -> float:
    """The router's kvfleet_router_pool_desired_replicas for the default pool (the largest over versions)."""
    values = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("kvfleet_router_pool_desired_replicas{") and 'pool="default"' in line]
    return max(values, default=float("nan"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="1.5,2,2.5,3", help="requests/s of each step (both classes together)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per step and mode")
    p.add_argument("--batch-share", type=float, default=0.25, help="the share of arrivals that are batch requests")
    p.add_argument("--ttft-ms", type=float, default=1500.0, help="the interactive class's TTFT target")
    p.add_argument("--tpot-ms", type=float, default=100.0, help="the interactive class's TPOT target")
    p.add_argument("--goal", type=float, default=0.9, help="attainment a rate must reach to count for goodput")
    p.add_argument("--warmup", type=int, default=32, help="requests before the steps (the router's models learn)")
    p.add_argument("--seed", type=int, default=1)
    ns = p.parse_args(argv)
    try:
        rates = [float(x) for x in ns.rates.split(",")]
    except ValueError:
        p.error(f"--rates: comma-separated numbers, got {ns.rates!r}")
    if not rates or min(rates) <= 0:
        p.error(f"--rates must be > 0, got {ns.rates!r}")
    if not 0 <= ns.batch_share < 1:
        p.error(f"--batch-share must be in [0, 1), got {ns.batch_share}")
    for name in ("duration", "ttft_ms", "tpot_ms"):
        if not getattr(ns, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    targets = (ns.ttft_ms / 1000, ns.tpot_ms / 1000)
    ns.model, ns.engine_module, ns.engine_arg, ns.threads_per_engine, ns.pin_cores = "smollm2", None, [], 1, True
    log_dir = tempfile.mkdtemp(prefix="slo_goodput_bench_")
    procs: list[Proc] = []
    try:
        router = start_kv_fleet(ns, log_dir, procs)
        # the router's TTFT and TPOT models need observations before they predict (and so before targets route)
        asyncio.run(step(router.url, 1.0, ns.warmup, ns.batch_share, ns.seed, None, "warm-up"))
        print(f"two engines, one kv router, default flags; interactive targets TTFT {ns.ttft_ms:g} ms, TPOT "
              f"{ns.tpot_ms:g} ms; batch share {ns.batch_share:g}; {ns.duration:g} s per step and mode")
        rows: dict[str, list[tuple[float, dict]]] = {"kv": [], "slo": []}
        for k, rate in enumerate(rates):
            order = ("kv", "slo") if k % 2 == 0 else ("slo", "kv")
            for mode in order:
                before = httpx.get(router.url + "/metrics").text
                out, seconds = asyncio.run(step(router.url, rate, ns.duration, ns.batch_share, ns.seed + 1 + k,
                                                targets if mode == "slo" else None, f"{mode} {rate:g}"))
                s = summarize(out, seconds, *targets)
                rows[mode].append((rate, s))
                print(f"rate {rate:g}/s {mode:3}: interactive attainment {s['attainment']:.3f} of {s['sent']} "
                      f"(refused {s['refused']}), TTFT p90 {s['ttft_p90']:.2f} s, TPOT p90 "
                      f"{s['tpot_p90'] * 1000:.0f} ms; batch {s['batch']} served, {s['batch_tok_s']:.1f} tok/s; "
                      f"errors {s['errors']}", flush=True)
                if mode == "slo":  # how far the router's predictions were from what this step's streams saw
                    after = httpx.get(router.url + "/metrics").text
                    print(f"  desired replicas for the targets (two serve): {desired_replicas(after):g}", flush=True)
                    for what, target, low in (("ttft", 0.20, -5.0), ("tpot", 0.15, -0.2)):
                        report(what, target, low, before, after)
        g = {m: goodput(r, ns.goal) for m, r in rows.items()}
        ratio = f"{g['slo'] / g['kv']:.2f}x" if g["kv"] > 0 else "kv reaches no step"
        print(f"\ngoodput (highest rate with interactive attainment >= {ns.goal:g}): kv {g['kv']:g}/s, slo "
              f"{g['slo']:g}/s: {ratio} (target 1.5x)")
        for (rate, kv), (_, slo) in zip(rows["kv"], rows["slo"], strict=True):
            b = f"{slo['batch_tok_s'] / kv['batch_tok_s']:.2f}x" if kv["batch_tok_s"] > 0 else "-"
            print(f"  rate {rate:g}/s: attainment kv {kv['attainment']:.3f} slo {slo['attainment']:.3f}; batch "
                  f"tok/s slo/kv {b} (target >= 0.8x)")
        return 0
    finally:
        for proc in reversed(procs):
            proc.stop()


if __name__ == "__main__":
    sys.exit(main())

"""One engine flooded by one tenant's long prompts, another tenant's short chats (`python -m loadtest.flood_bench`;
issue 46): a real router with a tenants file (two tenants, equal shares, big budgets) over one real SmolLM2 engine
at its default flags (plus `--engine-arg`s), on loopback; it stops by itself.

- idle: tenant B alone, `--b-streams` streams each sending one short chat (~40 prompt tokens, `--b-max-tokens` out)
  every `--b-interval` s, for `--seconds`;
- flood: tenant A keeps `--a-streams` streams going, each a ~600-token prompt of its own (no shared prefix) and
  `--a-max-tokens` out, one after the other; after `--warmup` s, B sends as in idle for `--seconds`.

Prints B's TTFT p50/p99 idle and under the flood, their ratio against the target (flood p99 <= 1.5x idle p99 plus
one step of `--max-step-ms`, the engine's default step-time target), whether every B request was served, and A's
and B's output tokens/s (of the requests that ended within the measured seconds). B's TPOT p50/p99 too; with
`--b-tpot-ms`, B's requests carry that TPOT target (`x-llm-d-slo-tpot-ms`) and the flood's p99 is checked against it.
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

from deploy.ports import free_port
from loadtest.fairness_bench import KEYS, Fleet, one, tenants_file
from loadtest.router_overhead import pct
from loadtest.router_procs import PY

WORDS = ("harbour", "boat", "gull", "tide", "net", "rope", "mast", "sail", "pier", "storm", "fish", "market", "wind",
         "rain", "lamp", "house", "stone", "wall", "bell", "morning", "evening", "captain", "crew", "anchor", "wave",
         "shore", "light", "cloud", "salt", "deck", "engine", "cargo", "crate", "river", "bridge", "street", "window")


def long_prompt(rng: random.Random, words: int) -> str:
    """A prompt of its own (a fresh number first: no prefix shared with another request), then `words` words."""
    return f"Document {rng.randrange(10**9)}: " + " ".join(rng.choice(WORDS) for _ in range(words)) + \
        "\nSummarise the document above."


class OneEngine(Fleet):
    """fairness_bench's fleet with a single engine at its default flags (and `extra` ones)."""

    def __init__(self, ns, log_dir: str, extra: list[str]):
        self.ns, self.log_dir, self.procs = ns, log_dir, []
        port = free_port()
        self.engines = [self._start([PY, "-m", "kvfleet", "engine", "--model", "smollm2", "--port", str(port),
                                     "--log-level", "warning", *extra], f"http://127.0.0.1:{port}", "engine")]
        self.engines[0].wait_ready()


ENGINE_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total")


async def engine_counters(c: httpx.AsyncClient, engine: str) -> dict[str, float]:
    out = {}
    for line in (await c.get(engine + "/metrics")).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.split("{")[0] in ENGINE_COUNTERS:
            out[name.split("{")[0]] = float(value)
    return out


async def phase(url: str, engine: str, ns, flood: bool) -> dict:
    """B's steady chats for ns.seconds (after ns.warmup with A's flood on, when `flood`); per tenant: TTFTs, sent,
    ok, failed, and the output tokens of requests that ended within the measured seconds; the engine's own prompt
    and output tokens/s (of every tenant) over the same seconds."""
    out = {t: {"ttft": [], "tpot": [], "tokens": 0, "sent": 0, "ok": 0, "failed": 0} for t in "ab"}
    b_headers = {"x-llm-d-slo-tpot-ms": f"{ns.b_tpot_ms:g}"} if ns.b_tpot_ms else None
    rng = random.Random(46)
    stop = asyncio.Event()
    window: list[float] = []  # [start, end] of the measured seconds

    def record(t: str, res, t0: float | None = None) -> None:
        ttft, tokens, ok, ended = res
        o = out[t]
        o["ok" if ok else "failed"] += 1
        if len(window) == 2 and window[0] <= ended <= window[1]:
            o["tokens"] += tokens
        if ttft is not None and t == "b":
            o["ttft"].append(ttft)
            if t0 is not None and tokens > 1:
                o["tpot"].append((ended - t0 - ttft) / (tokens - 1))

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1000)) as c:
        async def flooder():
            while not stop.is_set():
                out["a"]["sent"] += 1
                record("a", await one(c, url, "a", ns.a_max_tokens, long_prompt(rng, ns.a_prompt_words)))

        async def b_stream(k: int):
            await asyncio.sleep(k * ns.b_interval / ns.b_streams)  # the streams' sends spread over the interval
            tasks, starts = [], []
            while time.perf_counter() < window[1] - 1e-3:
                out["b"]["sent"] += 1
                starts.append(time.perf_counter())
                tasks.append(asyncio.create_task(one(c, url, "b", ns.b_max_tokens, headers=b_headers)))
                await asyncio.sleep(ns.b_interval)
            for t0, res in zip(starts, await asyncio.gather(*tasks), strict=True):
                record("b", res, t0)

        floods = [asyncio.create_task(flooder()) for _ in range(ns.a_streams if flood else 0)]
        if flood:
            await asyncio.sleep(ns.warmup)
        before = await engine_counters(c, engine)
        window[:] = [time.perf_counter(), time.perf_counter() + ns.seconds]
        await asyncio.gather(*(b_stream(k) for k in range(ns.b_streams)))
        window[1] = max(window[1], time.perf_counter())  # B's last requests ended: A is counted as long
        after = await engine_counters(c, engine)
        stop.set()
        for f in floods:  # A's requests in flight are cancelled (the engine aborts them): the bench ends now
            f.cancel()
        await asyncio.gather(*floods, return_exceptions=True)
    seconds = window[1] - window[0]
    out["engine"] = {k.split(":")[1].removesuffix("_total") + "_per_s": (after[k] - before.get(k, 0.0)) / seconds
                     for k in after}
    for t in "ab":
        o = out[t]
        o["tokens_per_s"] = o["tokens"] / seconds
        o["ttft_p50"], o["ttft_p99"] = pct(o["ttft"], 50), pct(o["ttft"], 99)
        o["ttft_n"] = len(o.pop("ttft"))
        o["tpot_p50"], o["tpot_p99"] = (pct(o["tpot"], 50), pct(o["tpot"], 99)) if o["tpot"] else (None, None)
        o.pop("tpot")
    return out


def prompt_tokens(url: str, prompt: str) -> int:
    r = httpx.post(url + "/v1/chat/completions", timeout=600, headers={"authorization": f"Bearer {KEYS['a']}"},
                   json={"model": "smollm2", "messages": [{"role": "user", "content": prompt}], "max_tokens": 1})
    r.raise_for_status()
    return r.json()["usage"]["prompt_tokens"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=40.0, help="B's measured seconds in each phase")
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds of A's flood before B is measured")
    ap.add_argument("--a-streams", type=int, default=24)
    ap.add_argument("--a-prompt-words", type=int, default=560, help="words of A's prompts (~600 tokens)")
    ap.add_argument("--a-max-tokens", type=int, default=96)
    ap.add_argument("--b-streams", type=int, default=2)
    ap.add_argument("--b-interval", type=float, default=1.0)
    ap.add_argument("--b-max-tokens", type=int, default=32)
    ap.add_argument("--max-step-ms", type=float, default=150.0,
                    help="the engine's step-time target, for the target line (engine default)")
    ap.add_argument("--b-tpot-ms", type=float, default=0.0,
                    help="B's requests carry this TPOT target (x-llm-d-slo-tpot-ms); 0: none")
    ap.add_argument("--engine-arg", action="append", default=[], help="one more engine flag (repeatable)")
    ap.add_argument("--json", help="write the figures here")
    ns = ap.parse_args(argv)
    log_dir = tempfile.mkdtemp(prefix="flood-")
    fleet = OneEngine(ns, log_dir, ns.engine_arg)
    res: dict = {}
    try:
        url = fleet.router("router", tenants_file(f"{log_dir}/tenants.yaml")).url
        res["a_prompt_tokens"] = prompt_tokens(url, long_prompt(random.Random(0), ns.a_prompt_words))
        print(f"A's prompts: {res['a_prompt_tokens']} tokens, {ns.a_max_tokens} out, {ns.a_streams} streams; "
              f"B: {ns.b_streams} streams, one chat each per {ns.b_interval:g} s; logs in {log_dir}", flush=True)
        for name, flood in (("idle", False), ("flood", True)):
            res[name] = r = asyncio.run(phase(url, fleet.engines[0].url, ns, flood))
            a, b, e = r["a"], r["b"], r["engine"]
            tpot = (f", TPOT p50 {b['tpot_p50'] * 1000:.0f} ms p99 {b['tpot_p99'] * 1000:.0f} ms"
                    if b["tpot_p99"] is not None else "")
            print(f"{name:6s} B: TTFT p50 {b['ttft_p50']:.2f} s p99 {b['ttft_p99']:.2f} s{tpot}, served {b['ok']}/{b['sent']} "
                  f"({b['failed']} failed), {b['tokens_per_s']:.1f} tok/s | A: {a['tokens_per_s']:.1f} tok/s, "
                  f"{a['ok']} done | engine: {e['prompt_tokens_per_s']:.0f} prompt + "
                  f"{e['generation_tokens_per_s']:.1f} output tok/s", flush=True)
    finally:
        fleet.stop()
    idle, flood = res["idle"]["b"], res["flood"]["b"]
    target = 1.5 * idle["ttft_p99"] + ns.max_step_ms / 1000
    res["p99_ratio"] = flood["ttft_p99"] / idle["ttft_p99"]
    res["target_s"] = target
    served = idle["ok"] == idle["sent"] and flood["ok"] == flood["sent"]
    print(f"B's TTFT p99 under the flood / idle: {res['p99_ratio']:.2f}x ({flood['ttft_p99']:.2f} s against a target "
          f"of {target:.2f} s = 1.5x idle + one {ns.max_step_ms:g} ms step: "
          f"{'met' if flood['ttft_p99'] <= target else 'MISSED'}); every B request served: {served}", flush=True)
    if ns.b_tpot_ms and flood["tpot_p99"] is not None:
        met = flood["tpot_p99"] * 1000 <= ns.b_tpot_ms
        print(f"B's TPOT p99 under the flood: {flood['tpot_p99'] * 1000:.0f} ms against its target of "
              f"{ns.b_tpot_ms:g} ms: {'met' if met else 'MISSED'}", flush=True)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if served else 1


if __name__ == "__main__":
    sys.exit(main())

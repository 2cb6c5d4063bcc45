"""A usage ledger that loses nothing when routers die mid-stream (issue 47), measured.

Two routers share one Redis in front of two real engines of the bundled model; clients stream chat requests
through both; router A is SIGKILLed mid-stream `--kills` times (restarted on the same port each time), with
`--usage-reconcile-after` short, so the requests it never settled are closed within the run from what their
engines say they used (router/tenants/reconcile.py). At the end, with every pending record closed, it prints the
ledger's totals next to the engines' own counters, as ratios, and checks:

- prompt and output tokens summed over the ledger = the engines' `vllm:prompt_tokens` / `vllm:generation_tokens`;
- cached tokens summed over the ledger = what the engines' usage lookups say for the same requests (and, beside
  it, `vllm:prefix_cache_hits`, which also counts requests aborted before their first token);
- no request id recorded twice; every request the engines ran (`vllm:request_success`, every finish reason) has
  exactly one record, with the tokens its engine says it used;
- the budget tokens charged to the tenant (Redis's charged counter) = the ledger's summed `budget_tokens`.

    python -m loadtest.ledger_kill_bench --kills 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from fractions import Fraction

import httpx
import redis

from contract.usage_lookup import PATH as LOOKUP
from deploy.ports import free_port
from deploy.redis_server import RedisServer
from loadtest.router_procs import PY, Proc
from router.tenants.ledger import decimal_text
from router.tenants.registry import key_sha256

KEY = "sk-kill-bench-7Hq2Lm9Xz"
TENANT = "acme"
TENANTS = f"""tenants:
  {TENANT}:
    api_key_sha256: ["{key_sha256(KEY)}"]
    tokens_per_minute: 50000000
model_prices:
  smollm2: {{input: 0.10, cached_input: 0.025, output: 0.40}}
"""
SYSTEM = ("You are the harbour master's assistant. Answer questions about ferries, tides, berths and the fish "
          "market in one or two friendly sentences, and never invent a timetable you were not given.")


def engine_argv(port: int, name: str, max_num_seqs: int) -> list[str]:
    return [PY, "-m", "kvfleet", "engine", "--model", "smollm2", "--port", str(port), "--instance-id", name,
            "--num-threads", "1", "--max-num-seqs", str(max_num_seqs), "--log-level", "warning"]


def router_argv(port: int, engines: list[str], tenants: str, redis_url: str, reconcile_after: float) -> list[str]:
    return [PY, "-m", "router.main", "--port", str(port), "--policy", "kv", "--model", "smollm2",
            "--default-model", "smollm2", "--replicas", ",".join(engines), "--health-interval", "0.2",
            "--scrape-interval", "0.2", "--log-level", "warning", "--tenants", tenants, "--redis-url", redis_url,
            "--usage-reconcile-after", str(reconcile_after)]


def kill(p: Proc) -> None:
    if p.popen.poll() is None:
        os.killpg(p.popen.pid, signal.SIGKILL)
        p.popen.wait()


def counters(url: str) -> dict[str, float]:
    out: dict[str, float] = Counter()
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


class Clients:
    """Streaming chat clients, half through each router, until stopped; counts what they saw."""

    def __init__(self, urls: list[str], n: int, max_tokens: tuple[int, int], seed: int):
        self.urls, self.n, self.max_tokens = urls, n, max_tokens
        self.rng = random.Random(seed)
        self.stop = False
        self.streaming = [0] * len(urls)  # streams past their first token, by router
        self.done = Counter()

    async def one(self, client: httpx.AsyncClient, which: int, i: int) -> None:
        body = {"model": "smollm2", "stream": True, "temperature": 0, "ignore_eos": True,
                "max_tokens": self.rng.randint(*self.max_tokens),
                "messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": f"Question {i}: when does ferry {i % 17} leave?"}]}
        started = False
        try:
            async with client.stream("POST", self.urls[which] + "/v1/chat/completions", json=body,
                                     headers={"authorization": f"Bearer {KEY}"}) as r:
                if r.status_code != 200:
                    self.done[f"http_{r.status_code}"] += 1
                    await r.aread()
                    return
                async for line in r.aiter_lines():
                    if not started and line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                        started = True
                        self.streaming[which] += 1
                self.done["complete"] += 1
        except httpx.HTTPError:
            self.done["broken" if started else "refused"] += 1
            if not started:  # the router is down: it is back within seconds
                await asyncio.sleep(0.2)
        finally:
            if started:
                self.streaming[which] -= 1

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=2)) as client:
            async def loop(c: int) -> None:
                i = c
                while not self.stop:
                    await self.one(client, c % len(self.urls), i)
                    i += self.n
            await asyncio.gather(*(loop(c) for c in range(self.n)))


async def kill_loop(doomed: Proc, argv: list[str], clients: Clients, kills: int, rng: random.Random) -> list[float]:
    """SIGKILL router 0 while streams run through it, `kills` times, restarting it on the same port."""
    downtime = []
    for _ in range(kills):
        while clients.streaming[0] == 0:
            await asyncio.sleep(0.02)
        await asyncio.sleep(rng.uniform(0.0, 0.3))  # somewhere mid-stream
        kill(doomed)
        t = time.monotonic()
        doomed.popen = subprocess.Popen(argv, stdout=doomed.log, stderr=subprocess.STDOUT, start_new_session=True,
                                        env={**os.environ, "HF_HUB_OFFLINE": "1"})
        await asyncio.to_thread(doomed.wait_ready, 120)
        downtime.append(time.monotonic() - t)
        await asyncio.sleep(0.3)
    return downtime


def ledger_rows(r: redis.Redis) -> list[dict]:
    return [json.loads(f[b"r"]) for _, f in r.xrange(f"kvfleet:usage:{{{TENANT}}}")]


def run(kills: int, clients: int, max_tokens: tuple[int, int], reconcile_after: float, workdir: str,
        seed: int = 0, max_num_seqs: int = 4) -> dict:
    """The run's figures (see `check`)."""
    tenants = os.path.join(workdir, "tenants.yaml")
    with open(tenants, "w") as f:
        f.write(TENANTS)
    rs = RedisServer(workdir).start()
    procs: list[Proc] = []
    try:
        engines = [Proc(engine_argv(p := free_port(), f"k{i}", max_num_seqs), f"http://127.0.0.1:{p}", workdir,
                        f"engine-{i}") for i in range(2)]
        procs += engines
        for e in engines:
            e.wait_ready(600)
        urls = [e.url for e in engines]
        argvs = [router_argv(free_port(), urls, tenants, rs.url, reconcile_after) for _ in range(2)]
        routers = [Proc(a, "http://127.0.0.1:" + a[a.index("--port") + 1], workdir, f"router-{i}")
                   for i, a in enumerate(argvs)]
        procs += routers
        for rt in routers:
            rt.wait_ready(120)
        before = [counters(u) for u in urls]
        load = Clients([rt.url for rt in routers], clients, max_tokens, seed)

        async def drive() -> list[float]:
            runner = asyncio.ensure_future(load.run())
            try:
                return await kill_loop(routers[0], argvs[0], load, kills, random.Random(seed))
            finally:
                load.stop = True
                await runner

        t0 = time.monotonic()
        downtime = asyncio.run(drive())
        drive_s = time.monotonic() - t0
        client = redis.Redis.from_url(rs.url)
        pending_key = f"kvfleet:usage:{{{TENANT}}}:pending"
        deadline = time.monotonic() + max(90.0, 10 * reconcile_after)
        while client.hlen(pending_key) and time.monotonic() < deadline:  # every router reconciles each ~10 s
            time.sleep(0.5)
        settle_s = time.monotonic() - t0 - drive_s
        after = [counters(u) for u in urls]
        rows = ledger_rows(client)
        ids = [r["request_id"] for r in rows]
        known: dict[str, list[dict]] = {}
        for u in urls:
            data = httpx.post(u + LOOKUP, json={"request_ids": ids}, timeout=30).json()["data"]
            for rid, v in data.items():
                if isinstance(v, dict):
                    known.setdefault(rid, []).append(v)

        def delta(name: str) -> float:
            return sum(a[name] - b[name] for a, b in zip(after, before, strict=True))

        mismatched = [r["request_id"] for r in rows if r["request_id"] in known and len(known[r["request_id"]]) == 1
                      and (r["prompt_tokens"], r["cached_tokens"], r["output_tokens"]) != tuple(
                          known[r["request_id"]][0][k] for k in ("prompt_tokens", "cached_tokens", "completion_tokens"))]
        return {
            "kills": kills, "downtime_s": downtime, "drive_s": drive_s, "settle_s": settle_s,
            "client_outcomes": dict(load.done), "pending_left": client.hlen(pending_key),
            "records": len(rows), "distinct_ids": len(set(ids)),
            "outcomes": dict(Counter(r["outcome"] for r in rows)),
            "ledger": {k: sum(r[f] for r in rows) for k, f in (("prompt", "prompt_tokens"), ("cached", "cached_tokens"),
                                                                ("output", "output_tokens"))},
            "engines": {"prompt": delta("vllm:prompt_tokens_total"), "output": delta("vllm:generation_tokens_total"),
                        "prefix_cache_hits": delta("vllm:prefix_cache_hits_total"),
                        "requests": delta("vllm:request_success_total")},
            "lookup_cached": sum(v[0]["cached_tokens"] for v in known.values() if len(v) == 1),
            "known_to_an_engine": sum(len(v) for v in known.values()),
            "known_to_two_engines": sum(1 for v in known.values() if len(v) > 1),
            "lost_known_to_an_engine": sum(1 for r in rows if r["outcome"] == "router_lost" and r["request_id"] in known),
            "mismatched_records": len(mismatched),
            "charged": int(client.get(f"kvfleet:budget:{{{TENANT}}}:charged") or 0),
            "ledger_budget_tokens": sum(r["budget_tokens"] for r in rows),
            "ledger_cost_usd": decimal_text(sum((Fraction(r["cost_usd"]) for r in rows if r["cost_usd"]), Fraction(0))),
        }
    finally:
        for p in reversed(procs):
            kill(p)
            p.log.close()
        rs.stop()


def check(f: dict) -> list[str]:
    """What is wrong with a run's figures (nothing: [])."""
    bad = []
    led, eng = f["ledger"], f["engines"]
    for k in ("prompt", "output"):
        if led[k] != eng[k]:
            bad.append(f"ledger {k} tokens {led[k]} != engines' {eng[k]:.0f}")
    if led["cached"] != f["lookup_cached"]:
        bad.append(f"ledger cached tokens {led['cached']} != the engines' lookups' {f['lookup_cached']}")
    if f["records"] != f["distinct_ids"]:
        bad.append(f"{f['records'] - f['distinct_ids']} request ids recorded twice")
    if f["known_to_an_engine"] != eng["requests"] or f["known_to_two_engines"]:
        bad.append(f"engines ran {eng['requests']:.0f} requests; {f['known_to_an_engine']} ledger records match one")
    for k in ("pending_left", "mismatched_records", "lost_known_to_an_engine"):
        if f[k]:
            bad.append(f"{k}: {f[k]}")
    if f["charged"] != f["ledger_budget_tokens"]:
        bad.append(f"budget charged {f['charged']} != ledger budget_tokens {f['ledger_budget_tokens']}")
    if f["outcomes"].get("router_lost_settled", 0) == 0 and f["kills"]:
        bad.append("no request was closed from its engine's usage: the kills hit nothing in flight")
    return bad


def report(f: dict) -> str:
    led, eng = f["ledger"], f["engines"]

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.4f}" if b else "n/a"

    d = f["downtime_s"]
    lines = [
        f"router kills: {f['kills']} (restart to ready: mean {sum(d) / len(d) if d else 0:.2f} s); driven "
        f"{f['drive_s']:.1f} s, all pending closed {f['settle_s']:.1f} s later; clients: {f['client_outcomes']}",
        f"ledger records: {f['records']} ({f['distinct_ids']} distinct ids), by outcome {f['outcomes']}",
        f"prompt tokens: ledger {led['prompt']} / engines' vllm:prompt_tokens {eng['prompt']:.0f} = "
        f"{ratio(led['prompt'], eng['prompt'])}",
        f"output tokens: ledger {led['output']} / engines' vllm:generation_tokens {eng['output']:.0f} = "
        f"{ratio(led['output'], eng['output'])}",
        f"cached tokens: ledger {led['cached']} / engines' lookups {f['lookup_cached']} = "
        f"{ratio(led['cached'], f['lookup_cached'])} (vllm:prefix_cache_hits {eng['prefix_cache_hits']:.0f})",
        f"requests the engines ran: {eng['requests']:.0f}; ledger records matching one engine's: "
        f"{f['known_to_an_engine']}; with other tokens than it says: {f['mismatched_records']}; router_lost ones an "
        f"engine knew: {f['lost_known_to_an_engine']}; pending left: {f['pending_left']}",
        f"budget tokens charged (Redis) {f['charged']} / ledger's summed budget_tokens {f['ledger_budget_tokens']} = "
        f"{ratio(f['charged'], f['ledger_budget_tokens'])}; ledger cost ${f['ledger_cost_usd']}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--clients", type=int, default=8, help="concurrent streaming clients, half per router")
    p.add_argument("--max-tokens", type=int, nargs=2, default=(16, 48), metavar=("MIN", "MAX"))
    p.add_argument("--reconcile-after", type=float, default=2.0, help="the routers' --usage-reconcile-after")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", help="keep the processes' logs here (default: a temporary directory)")
    ns = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ledger-kill-") as d:
        workdir = ns.workdir or d
        os.makedirs(workdir, exist_ok=True)
        f = run(ns.kills, ns.clients, tuple(ns.max_tokens), ns.reconcile_after, workdir, ns.seed)
    print(report(f))
    bad = check(f)
    print("OK: nothing lost, nothing twice" if not bad else "FAILED:\n  " + "\n  ".join(bad))
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())

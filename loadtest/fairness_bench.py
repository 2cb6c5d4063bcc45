"""Fair share and priority on a saturated fleet (`python -m loadtest.fairness_bench`): real SmolLM2 engines (one
core each, `--max-num-seqs` small so the fleet fills), routers with tenants, on loopback. Every request is a
chat with a ~40-token prompt and `--max-tokens` tokens generated (EOS ignored), streamed.

Scenarios (each `--seconds` long; the figures of each are printed as it ends):
- idle: tenant B alone, one request every `--b-interval` s (its TTFT p50/p99 on an idle fleet);
- fcfs: A floods (`--flood` requests always outstanding, about 10x what the fleet runs at once) while B sends as
  in idle, through a router without a queue (today: everything goes to the engines, first come, first served);
- fair: the same through a router with `--replica-slots` = the engines' max-num-seqs (the Virtual Token Counter
  queue); target: B's TTFT p99 <= 1.5x its idle p99, A gets the rest (tokens/s of both);
- weights: A (weight 3) and B (weight 1) both flood; target: generated tokens A:B within 10% of 3:1;
- two-routers: fair, with every client request going to one of two routers in turn (each router queues on its
  own, and sees the other's load only through the engines' metrics); two-weights: weights through two routers;
- priority: B is a high-priority tenant (priority 10) with the engines on `--scheduling-policy priority` and the
  router forwarding tenants' priorities, no queue; target: B's TTFT p99 <= 1.5x idle, A still completes;
- express: fair, with the engines on `--scheduling-policy priority` and the router's express lane
  (`--forward-priority`): B, under its share of the seats, goes straight on and runs ahead (equal priorities);
- two-express: express through two routers, every client request to one of them in turn;
- priority-queue: priority with the queue on as well (`--replica-slots`): B, priority 10, also under its share.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

import httpx

from deploy.ports import free_port
from loadtest.router_overhead import pct
from loadtest.router_procs import PY, Proc
from router.tenants.registry import key_sha256

KEYS = {"a": "sk-fair-a", "b": "sk-fair-b"}
PROMPT = "Write a short note about the weather in a harbour town, the boats and the gulls."


def tenants_file(path: str, weight_a: float = 1.0, priority_b: int = 0) -> str:
    with open(path, "w") as f:
        f.write(f"""tenants:
  a:
    api_key_sha256: ["{key_sha256(KEYS['a'])}"]
    tokens_per_minute: 100000000
    weight: {weight_a}
  b:
    api_key_sha256: ["{key_sha256(KEYS['b'])}"]
    tokens_per_minute: 100000000
    priority: {priority_b}
""")
    return path


class Fleet:
    def __init__(self, ns, log_dir: str, policy: str = "fcfs"):
        self.ns, self.log_dir, self.procs = ns, log_dir, []
        self.engines = []
        for i in range(ns.engines):
            port = free_port()
            self.engines.append(self._start([PY, "-m", "kvfleet", "engine", "--model", "smollm2", "--port", str(port),
                                             "--num-threads", "1", "--cpu-cores", str(i % os.cpu_count()),
                                             "--max-num-seqs", str(ns.max_num_seqs), "--scheduling-policy", policy,
                                             "--log-level", "warning"], f"http://127.0.0.1:{port}", f"engine-{i}"))
        for e in self.engines:
            e.wait_ready()

    def _start(self, argv, url, name) -> Proc:
        p = Proc(argv, url, self.log_dir, name)
        self.procs.append(p)
        return p

    def router(self, name: str, tenants: str, *extra: str) -> Proc:
        port = free_port()
        r = self._start([PY, "-m", "router.main", "--port", str(port), "--policy", "least-load", "--model", "smollm2",
                         "--replicas", ",".join(e.url for e in self.engines), "--tenants", tenants,
                         "--default-model", "smollm2", "--scrape-interval", "0.2", "--log-level", "warning", *extra],
                        f"http://127.0.0.1:{port}", name)
        r.wait_ready()
        return r

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


async def one(client: httpx.AsyncClient, url: str, tenant: str, max_tokens: int, prompt: str = PROMPT,
              headers: dict[str, str] | None = None) -> tuple[float | None, int, bool, float]:
    """(TTFT, tokens generated, ok, when it ended) of one streamed chat (with `headers` besides the tenant's key)."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                 headers={"authorization": f"Bearer {KEYS[tenant]}", **(headers or {})}) as r:
            if r.status_code != 200:
                await r.aread()
                return None, 0, False, time.perf_counter()
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                try:
                    chunk = json.loads(line[6:])
                except ValueError:
                    continue
                if ttft is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", ())):
                    ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        return ttft, tokens, True, time.perf_counter()
    except httpx.HTTPError:
        return None, 0, False, time.perf_counter()


async def scenario(urls: list[str], seconds: float, max_tokens: int, flood: dict[str, int],
                   steady: dict[str, float]) -> dict:
    """`flood[t]` requests of tenant t always outstanding; `steady[t]`: one request of t every that many seconds.
    Requests go to `urls` in turn. Per tenant: TTFTs, requests ok and failed, and the tokens of the requests that
    ended within the `seconds` (after it, the floods drain: whoever has most queued would look better served)."""
    out = {t: {"ttft": [], "tokens": 0, "ok": 0, "failed": 0} for t in {**flood, **steady}}
    start = time.perf_counter()
    deadline = start + seconds
    turn = [0]

    def url() -> str:
        turn[0] += 1
        return urls[turn[0] % len(urls)]

    def record(t, res):
        ttft, tokens, ok, ended = res
        o = out[t]
        o["ok" if ok else "failed"] += 1
        o["tokens"] += tokens if ended <= deadline else 0
        if ttft is not None:
            o["ttft"].append(ttft)

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=1000)) as c:
        async def flooder(t):
            while time.perf_counter() < deadline:
                record(t, await one(c, url(), t, max_tokens))

        async def steady_sender(t, interval):
            tasks = []
            while time.perf_counter() < deadline:
                tasks.append(asyncio.create_task(one(c, url(), t, max_tokens)))
                await asyncio.sleep(interval)
            for res in await asyncio.gather(*tasks):
                record(t, res)

        workers = [flooder(t) for t, n in flood.items() for _ in range(n)]
        workers += [steady_sender(t, i) for t, i in steady.items()]
        await asyncio.gather(*workers)
    for o in out.values():
        o["tokens_per_s"] = o["tokens"] / seconds
        o["ttft_p50"], o["ttft_p99"] = pct(o["ttft"], 50), pct(o["ttft"], 99)
        del o["ttft"]
    return out


def show(name: str, res: dict) -> None:
    parts = [f"{t}: TTFT p50 {o['ttft_p50']:.2f} s p99 {o['ttft_p99']:.2f} s, {o['tokens_per_s']:.0f} tok/s, "
             f"{o['ok']} ok {o['failed']} failed" for t, o in sorted(res.items())]
    print(f"{name:12s} " + " | ".join(parts), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--flood", type=int, default=None, help="A's outstanding requests (default 10x the fleet's seats)")
    ap.add_argument("--b-interval", type=float, default=1.0)
    ap.add_argument("--scenarios",
                    default="idle,fcfs,fair,weights,two-routers,two-weights,priority,express,two-express,"
                            "priority-queue")
    ap.add_argument("--json", help="write the figures here")
    ns = ap.parse_args(argv)
    flood = ns.flood or 10 * ns.engines * ns.max_num_seqs
    slots = str(ns.max_num_seqs)
    log_dir = tempfile.mkdtemp(prefix="fairness-")
    want = ns.scenarios.split(",")
    res: dict = {}

    def run(name, urls, flood_map, steady_map):
        res[name] = asyncio.run(scenario(urls, ns.seconds, ns.max_tokens, flood_map, steady_map))
        show(name, res[name])

    fleet = Fleet(ns, log_dir)
    try:
        plain = tenants_file(os.path.join(log_dir, "tenants.yaml"))
        if "idle" in want:
            run("idle", [fleet.router("router-idle", plain).url], {}, {"b": ns.b_interval})
        if "fcfs" in want:
            run("fcfs", [fleet.router("router-fcfs", plain).url], {"a": flood}, {"b": ns.b_interval})
        if "fair" in want:
            run("fair", [fleet.router("router-fair", plain, "--replica-slots", slots).url], {"a": flood},
                {"b": ns.b_interval})
        if "weights" in want:
            weighted = tenants_file(os.path.join(log_dir, "tenants-3-1.yaml"), weight_a=3.0)
            run("weights", [fleet.router("router-weights", weighted, "--replica-slots", slots).url],
                {"a": flood // 2, "b": flood // 2}, {})
            w = res["weights"]
            print(f"{'':12s} tokens A:B = {w['a']['tokens'] / max(w['b']['tokens'], 1):.2f} (target 3 +- 10%)",
                  flush=True)
        if "two-weights" in want:
            weighted = tenants_file(os.path.join(log_dir, "tenants-3-1.yaml"), weight_a=3.0)
            urls = [fleet.router(f"router-two-weights-{i}", weighted, "--replica-slots", slots).url for i in range(2)]
            run("two-weights", urls, {"a": flood // 2, "b": flood // 2}, {})
            w = res["two-weights"]
            print(f"{'':12s} tokens A:B = {w['a']['tokens'] / max(w['b']['tokens'], 1):.2f} (target 3 +- 10%)",
                  flush=True)
        if "two-routers" in want:
            urls = [fleet.router(f"router-two-{i}", plain, "--replica-slots", slots).url for i in range(2)]
            run("two-routers", urls, {"a": flood}, {"b": ns.b_interval})
    finally:
        fleet.stop()
    if {"priority", "express", "two-express", "priority-queue"} & set(want):
        fleet = Fleet(ns, log_dir, policy="priority")
        try:
            if "priority" in want:
                ranked = tenants_file(os.path.join(log_dir, "tenants-priority.yaml"), priority_b=10)
                run("priority", [fleet.router("router-priority", ranked, "--forward-priority").url], {"a": flood},
                    {"b": ns.b_interval})
            if "express" in want:
                run("express", [fleet.router("router-express", plain, "--replica-slots", slots,
                                             "--forward-priority").url], {"a": flood}, {"b": ns.b_interval})
            if "priority-queue" in want:
                ranked = tenants_file(os.path.join(log_dir, "tenants-priority.yaml"), priority_b=10)
                run("priority-queue", [fleet.router("router-priority-queue", ranked, "--replica-slots", slots,
                                                    "--forward-priority").url], {"a": flood}, {"b": ns.b_interval})
            if "two-express" in want:
                urls = [fleet.router(f"router-two-express-{i}", plain, "--replica-slots", slots,
                                     "--forward-priority").url for i in range(2)]
                run("two-express", urls, {"a": flood}, {"b": ns.b_interval})
        finally:
            fleet.stop()
    if "idle" in res:
        idle = res["idle"]["b"]["ttft_p99"]
        for name in ("fcfs", "fair", "two-routers", "priority", "express", "two-express", "priority-queue"):
            if name in res:
                print(f"B's TTFT p99 / idle, {name}: {res[name]['b']['ttft_p99'] / idle:.2f} (target <= 1.5 for "
                      f"fair and priority)", flush=True)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the token-budget limiter costs (`python -m loadtest.ratelimit_bench`): two routers in front of the
same fast fake engines, one without tenants and one with `--tenants` and budgets in a real Redis
(deploy/redis_server.py). Sequential requests alternate between them (latency the limiter adds: identify
the key, reserve in Redis, settle in Redis, p50 and p99), then each router's streamed requests/s under
load from separate client processes. Targets (issue 12): < 1 ms added at p50, >= 1,000 requests/s."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import httpx

from deploy.redis_server import RedisServer
from loadtest.router_overhead import latencies, pct, streamed_rps
from loadtest.router_procs import Proc, start_fake_engines, start_router
from router.tenants.registry import key_sha256

KEY = "sk-bench-tenant-key"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000, help="sequential requests per router (latency)")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of each throughput run")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--client-procs", type=int, default=2)
    ap.add_argument("--upstreams", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--policy", default="kv")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--json", help="write the figures here")
    ns = ap.parse_args(argv)
    log_dir = tempfile.mkdtemp(prefix="ratelimit-bench-")
    tenants = os.path.join(log_dir, "tenants.yaml")
    with open(tenants, "w") as f:  # a budget no run can exhaust: every request is admitted, reserved, settled
        f.write(f"tenants:\n  bench:\n    api_key_sha256: [\"{key_sha256(KEY)}\"]\n"
                f"    tokens_per_minute: 1000000000\n    max_tokens: 64\n")
    redis = RedisServer(log_dir).start()
    procs: list[Proc] = []
    try:
        fakes = start_fake_engines(ns.upstreams, ns.chunks, log_dir)
        procs += fakes
        urls = [f.url for f in fakes]
        plain = start_router(ns, log_dir, urls, ns.policy, ns.model)
        ns.router_arg = ["--tenants", tenants, "--redis-url", redis.url, "--ratelimit-on-store-error", "closed"]
        limited = start_router(ns, log_dir, urls, ns.policy, ns.model)
        procs += [plain, limited]
        plain.wait_ready()
        limited.wait_ready()
        auth = {"authorization": f"Bearer {KEY}"}
        latencies(plain.url, 50, True)
        latencies(limited.url, 50, True, extra_headers=auth)
        res: dict = {"redis": redis.url}
        for stream in (False, True):
            a, b = [], []
            for k in range(max(1, ns.requests // 50)):  # interleaved: drift hits both equally
                a += latencies(plain.url, 50, stream, seed=k)
                b += latencies(limited.url, 50, stream, seed=k, extra_headers=auth)
            tag = "stream" if stream else "json"
            for name, xs in (("plain", a), ("limited", b)):
                res[f"{tag}_{name}_p50_ms"], res[f"{tag}_{name}_p99_ms"] = pct(xs, 50) * 1e3, pct(xs, 99) * 1e3
            res[f"{tag}_added_p50_ms"] = res[f"{tag}_limited_p50_ms"] - res[f"{tag}_plain_p50_ms"]
            res[f"{tag}_added_p99_ms"] = res[f"{tag}_limited_p99_ms"] - res[f"{tag}_plain_p99_ms"]
            print(f"{tag:6s}: router p50 {res[f'{tag}_plain_p50_ms']:.2f} ms p99 {res[f'{tag}_plain_p99_ms']:.2f} | "
                  f"with tenants + Redis p50 {res[f'{tag}_limited_p50_ms']:.2f} p99 {res[f'{tag}_limited_p99_ms']:.2f}"
                  f" | added p50 {res[f'{tag}_added_p50_ms']:.2f} ms (target < 1) p99 "
                  f"{res[f'{tag}_added_p99_ms']:.2f} ms", flush=True)
        rps_b, err_b = streamed_rps(limited.url, ns, auth)
        rps_a, err_a = streamed_rps(plain.url, ns)
        res.update(limited_rps=rps_b, limited_errors=err_b, plain_rps=rps_a, plain_errors=err_a)
        m = httpx.get(limited.url + "/metrics").text
        outcomes: dict[str, float] = {}
        for x in m.splitlines():
            if x.startswith("kvfleet_router_ratelimit_requests_total{"):
                outcome = x.split('outcome="', 1)[1].split('"', 1)[0]
                outcomes[outcome] = outcomes.get(outcome, 0) + float(x.rsplit(" ", 1)[1])
        admitted = outcomes.get("admitted", 0.0)
        res["limited_outcomes"] = outcomes
        res["limited_admitted"] = admitted
        print(f"streamed requests/s, one router: with tenants + Redis {rps_b:.0f} (target >= 1000; errors {err_b}, "
              f"{admitted:.0f} admitted in all, outcomes {outcomes}), without {rps_a:.0f} (errors {err_a}); ratio {rps_b / max(rps_a, 1e-9):.2f}"
              f" ({ns.upstreams} fake upstreams, {ns.concurrency} connections, {os.cpu_count()} CPUs)", flush=True)
        if ns.json:
            with open(ns.json, "w") as f:
                json.dump(res, f, indent=2)
        return 0
    finally:
        for p in reversed(procs):
            p.stop()
        redis.stop()


if __name__ == "__main__":
    sys.exit(main())

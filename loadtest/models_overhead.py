"""What routing by model costs (`python -m loadtest.models_overhead`): three routers in front of the same fast fake
engines: one model without a pools file (`--replicas`, the engines of `smollm2`), the same model in a pools file
of one pool (pools send streams upstream with usage, to measure them), and two models in four pools (each model a
stable pool at weight 90 and a canary at 10, one engine each; requests draw either model). Sequential requests go to the engine directly and to each router in turn (the
latency each router adds, p50 and p99), then each router's streamed requests/s under load from separate client
processes. Target (issue 29): two models and four pools add at most 0.1 ms at p50 over one model."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from loadtest.router_overhead import latencies, pct, streamed_rps
from loadtest.router_procs import PY, Proc, free_port, start_fake_engines, start_router

MODELS = ("smollm2", "smollm2-b")
TARGET_MS = 0.1


def pools_file(a: list[str], b: list[str] | None = None) -> str:
    if b is None:
        return f"pools:\n  stable:\n    version: v1\n    weight: 1\n    model: {MODELS[0]}\n    replicas: [{', '.join(a)}]\n"
    pools = []
    for model, urls in ((MODELS[0], a), (MODELS[1], b)):
        for url, (role, weight) in zip(urls, (("stable", 90), ("canary", 10)), strict=True):
            pools.append(f"  {model}-{role}:\n    version: v1\n    weight: {weight}\n    model: {model}\n"
                         f"    replicas: [{url}]\n")
    return "pools:\n" + "".join(pools)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000, help="sequential requests per path (latency)")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of each throughput run")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--client-procs", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--policy", default="kv")
    ap.add_argument("--json", help="write the figures here")
    ns = ap.parse_args(argv)
    log_dir = tempfile.mkdtemp(prefix="models-bench-")
    procs: list[Proc] = []
    try:
        a = start_fake_engines(2, ns.chunks, log_dir, MODELS[0])
        b = start_fake_engines(2, ns.chunks, log_dir, MODELS[1], first=2)
        procs += a + b
        one = start_router(ns, log_dir, [f.url for f in a], ns.policy, "smollm2")
        procs.append(one)
        pooled = _pools_router(ns, log_dir, "one-pool", pools_file([x.url for x in a]))
        procs.append(pooled)
        two = _pools_router(ns, log_dir, "four-pools", pools_file([x.url for x in a], [x.url for x in b]))
        procs.append(two)
        for r in (one, pooled, two):
            r.wait_ready()
        routers = {"one model": (one, MODELS[:1]), "one model, one pool": (pooled, MODELS[:1]),
                   "two models": (two, MODELS)}
        paths = {"direct": (a[0].url, MODELS[:1]), **{k: (r.url, m) for k, (r, m) in routers.items()}}
        for url, models in paths.values():  # warm up every path
            latencies(url, 50, False, models=models)
        res: dict = {}
        for stream in (False, True):
            got: dict[str, list[float]] = {k: [] for k in paths}
            for k in range(ns.requests // 50 or 1):  # interleaved: drift hits every path alike
                for name, (url, models) in paths.items():
                    got[name] += latencies(url, 50, stream, seed=k, models=models)
            tag = "stream" if stream else "json"
            p50 = {k: pct(v, 50) * 1e3 for k, v in got.items()}
            p99 = {k: pct(v, 99) * 1e3 for k, v in got.items()}
            for name in routers:
                key = _key(name)
                res[f"{tag}_{key}_added_p50_ms"] = p50[name] - p50["direct"]
                res[f"{tag}_{key}_added_p99_ms"] = p99[name] - p99["direct"]
            delta = res[f"{tag}_two_models_added_p50_ms"] - res[f"{tag}_one_model_added_p50_ms"]
            res[f"{tag}_models_cost_p50_ms"] = delta
            added = ", ".join(f"{name} {res[f'{tag}_{_key(name)}_added_p50_ms']:.3f}" for name in routers)
            added99 = ", ".join(f"{res[f'{tag}_{_key(name)}_added_p99_ms']:.3f}" for name in routers)
            print(f"{tag:6s}: added p50 ms: {added}; two models / four pools - one model: {delta:+.3f} ms (target <= "
                  f"{TARGET_MS}) | added p99 ms: {added99}", flush=True)
        for name, (router, models) in routers.items():
            rps, errs = streamed_rps(router.url, ns, models=models)
            res[f"{_key(name)}_streamed_rps"] = rps
            print(f"streamed requests/s, {name}: {rps:.0f} (errors {errs})", flush=True)
        print(f"streamed requests/s, two models / one model: "
              f"{res['two_models_streamed_rps'] / res['one_model_streamed_rps']:.2f}; two models / one model in a "
              f"pools file: {res['two_models_streamed_rps'] / res['one_model_one_pool_streamed_rps']:.2f}", flush=True)
        if ns.json:
            with open(ns.json, "w") as f:
                json.dump(res, f, indent=2)
        return 0
    finally:
        for p in reversed(procs):
            p.stop()


def _key(name: str) -> str:
    return name.replace(", ", "_").replace(" ", "_")


def _pools_router(ns, log_dir: str, name: str, text: str) -> Proc:
    path = os.path.join(log_dir, f"{name}.yaml")
    with open(path, "w") as f:
        f.write(text)
    port = free_port()
    return Proc([PY, "-m", "router.main", "--port", str(port), "--policy", ns.policy, "--model", "smollm2", "--pools",
                 path, "--log-level", "warning"], f"http://127.0.0.1:{port}", log_dir, f"router-{name}")


if __name__ == "__main__":
    sys.exit(main())

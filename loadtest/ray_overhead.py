r"""What the Ray Serve path costs next to the plain kvfleet router, both in front of 2 fast fake engines
(loadtest/fake_engine.py: the engine's HTTP surface without a model, so only the routing path is measured):

- plain: client -> `kvfleet router` (HTTP, policy kv) -> 2 fake engine processes (HTTP);
- serve: client -> Serve's HTTP proxy -> the ingress (tokenizes, hashes) -> KVRequestRouter -> 2 EngineReplicas,
  each running the same fake engine app in-process (deploy/ray/app.py's `app_factory`:
  loadtest.fake_engine:make_app).

Prints added latency per request over a fake engine called directly (p50/p99, sequential, JSON and streamed,
the two paths interleaved) and the streamed requests/s each path sustains (separate client processes), with
the ratio serve / plain.

    python -m loadtest.ray_overhead --requests 1000 --duration 20 --concurrency 64 --client-procs 2   # full
    python -m loadtest.ray_overhead --requests 50 --duration 3 --concurrency 8 --client-procs 1       # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from deploy.ports import free_port
from loadtest.ray_serve import deploy, ray_serve, undeploy
from loadtest.router_overhead import latencies, pct, streamed_rps
from loadtest.router_procs import start_fake_engines, start_router


def serve_args(ns) -> dict:
    return {"engine": {"model": ns.model}, "policy": ns.policy, "replicas": 2, "num_cpus": 0.5,
            "app_factory": "loadtest.fake_engine:make_app", "app_options": {"chunks": ns.chunks},
            "max_ongoing_requests": 1000}


def run(ns) -> dict:
    log_dir = tempfile.mkdtemp(prefix="ray-overhead-")
    procs = []
    res: dict = {}
    try:
        fakes = start_fake_engines(2, ns.chunks, log_dir)
        procs += fakes
        router = start_router(ns, log_dir, [f.url for f in fakes], ns.policy, ns.model)
        procs.append(router)
        router.wait_ready()
        direct = fakes[0].url
        with ray_serve(ns.port) as serve_url:
            deploy(serve_args(ns), serve_url)
            paths = {"direct": direct, "plain": router.url, "serve": serve_url}
            for url in paths.values():
                latencies(url, 30, False)  # warm up
            for stream in (False, True):
                got: dict[str, list[float]] = {k: [] for k in paths}
                for k in range(max(ns.requests // 50, 1)):  # interleaved, so drift hits all paths alike
                    for name, url in paths.items():
                        got[name] += latencies(url, 50, stream, seed=k)
                tag = "stream" if stream else "json"
                for name, xs in got.items():
                    res[f"{tag}_{name}_p50_ms"], res[f"{tag}_{name}_p99_ms"] = pct(xs, 50) * 1e3, pct(xs, 99) * 1e3
                for name in ("plain", "serve"):
                    res[f"{tag}_{name}_added_p50_ms"] = res[f"{tag}_{name}_p50_ms"] - res[f"{tag}_direct_p50_ms"]
                    res[f"{tag}_{name}_added_p99_ms"] = res[f"{tag}_{name}_p99_ms"] - res[f"{tag}_direct_p99_ms"]
                print(f"{tag:6s}: added over a direct engine call - plain router p50 "
                      f"{res[f'{tag}_plain_added_p50_ms']:.2f} ms p99 {res[f'{tag}_plain_added_p99_ms']:.2f} ms | "
                      f"serve p50 {res[f'{tag}_serve_added_p50_ms']:.2f} ms p99 {res[f'{tag}_serve_added_p99_ms']:.2f}"
                      f" ms (direct p50 {res[f'{tag}_direct_p50_ms']:.2f} ms)", flush=True)
            for name in ("plain", "serve"):
                rps, errs = streamed_rps(paths[name], ns)
                res[f"{name}_streamed_rps"], res[f"{name}_stream_errors"] = rps, errs
            undeploy()
        res["serve_over_plain_rps"] = res["serve_streamed_rps"] / max(res["plain_streamed_rps"], 1e-9)
        print(f"streamed requests/s: plain router {res['plain_streamed_rps']:.0f} (errors {res['plain_stream_errors']})"
              f", serve {res['serve_streamed_rps']:.0f} (errors {res['serve_stream_errors']}); serve / plain "
              f"{res['serve_over_plain_rps']:.2f} ({ns.concurrency} connections, {ns.client_procs} client "
              f"processes, {os.cpu_count()} CPUs)", flush=True)
        return res
    finally:
        for p in reversed(procs):
            p.stop()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ray_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1000, help="sequential requests per path and mode for latency")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of each throughput run")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--client-procs", type=int, default=2)
    p.add_argument("--chunks", type=int, default=8, help="SSE chunks per streamed response")
    p.add_argument("--policy", default="kv")
    p.add_argument("--model", default="smollm2", help="whose tokenizer the router and the ingress load")
    p.add_argument("--port", type=int, default=None, help="Serve's HTTP port (default: a free one)")
    p.add_argument("--json", default=None, help="write the figures to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    ns.port = ns.port or free_port()
    out = run(ns)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

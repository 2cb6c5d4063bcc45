r"""Endpoint picker benchmarks (`kvfleet epp`, issue 48). Each prints its figure beside its peer, as a ratio.

`hit-rate`: the seeded multi-turn + shared-system-prompt workload of `router_bench policies`, once through the HTTP
router and once through the picker (asked over gRPC by the test gateway, tests/router/epp/gateway.py, which then
sends each request to the endpoint it was given), on the same engines, each run with its own cache_salt; prints
both fleet hit rates (from the engines' own /metrics), their ratio (target >= 0.98) and each endpoint's share of
the picker's requests (target: none above 0.75).

    python -m loadtest.epp_bench hit-rate --engines 2 --sessions 16 --turns 4 --concurrency 4
    # two unmodified vLLM-CPU engines started elsewhere (loadtest/vllm_fleet.py, docs/peers.md):
    python -m loadtest.epp_bench hit-rate --replica http://127.0.0.1:8101 --replica http://127.0.0.1:8102 \
        --engine-type vllm --vllm-kv-events 'tcp://{host}:5557|tcp://{host}:5558' --model smollm2

`latency`: what the picker adds to each request at 8, 64 and 256 endpoints (stub engines, loadtest/many_endpoints.py)
and open-loop request rates: the time a gateway waits on the ext_proc stream before it can connect upstream (request
headers + body -> destination + body back) plus the response's pass (response headers + body), p50/p99; beside it
what the HTTP router adds over the same endpoints (through the router minus directly to one of them, p50/p99).

    python -m loadtest.epp_bench latency --endpoints 8,64,256 --rates 20,100,400 --duration 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import sys
import tempfile
import threading
import time

import grpc
import httpx
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2

from deploy.ports import free_port
from loadtest.router_bench import build_sessions, fleet_prefix_counters
from loadtest.router_overhead import overhead_body, pct
from loadtest.router_procs import PY, Proc, start_engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_picker(log_dir: str, replicas: list[str], extra: list[str]) -> tuple[Proc, str]:
    port, metrics = free_port(), free_port()
    argv = [PY, "-m", "router.epp.main", "--port", str(port), "--metrics-port", str(metrics),
            "--replicas", ",".join(replicas), "--log-level", "warning", *extra]
    proc = Proc(argv, f"http://127.0.0.1:{metrics}", log_dir, "epp")
    proc.wait_ready(300)
    return proc, f"127.0.0.1:{port}"


def start_router(log_dir: str, replicas: list[str], extra: list[str]) -> Proc:
    port = free_port()
    proc = Proc([PY, "-m", "router.main", "--port", str(port), "--replicas", ",".join(replicas),
                 "--log-level", "warning", *extra], f"http://127.0.0.1:{port}", log_dir, "router")
    proc.wait_ready(300)
    return proc


def wait_all_ready(router: Proc, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(router.url + "/ready", timeout=2).json().get("ready_replicas") == n:
            time.sleep(1.0)  # the picker runs the same checks on the same interval
            return
        time.sleep(0.2)
    raise TimeoutError(f"the router does not see all {n} endpoints ready")


# -- hit rate --------------------------------------------------------------------------------------------------
def run_sessions(send, sessions, ns, salt: str) -> dict[str, int]:
    """Closed loop: `concurrency` threads, each runs whole sessions turn after turn; requests per endpoint."""
    todo = list(enumerate(sessions))
    lock = threading.Lock()
    served: dict[str, int] = {}
    errors: list[str] = []

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                sid, turns = todo.pop(0)
            for msgs in turns:
                body = {"model": ns.model, "messages": msgs, "max_tokens": ns.max_tokens, "temperature": 0,
                        "cache_salt": salt}
                try:
                    where = send(body, {"x-session-id": f"s{sid}"})
                except Exception as e:  # counted, reported; the run goes on
                    errors.append(str(e))
                    continue
                with lock:
                    served[where] = served.get(where, 0) + 1

    threads = [threading.Thread(target=worker) for _ in range(ns.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        print(f"  {len(errors)} failed requests, first: {errors[0]}", file=sys.stderr)
    return served


def hit_rate(send, urls, sessions, ns, salt: str) -> tuple[float, dict[str, int]]:
    q0, h0 = fleet_prefix_counters(urls)
    served = run_sessions(send, sessions, ns, salt)
    time.sleep(0.5)
    q1, h1 = fleet_prefix_counters(urls)
    return ((h1 - h0) / (q1 - q0) if q1 > q0 else float("nan")), served


def cmd_hit_rate(ns) -> dict:
    sys.path.insert(0, ROOT)
    from tests.router.epp.gateway import Gateway

    log_dir = tempfile.mkdtemp(prefix="epp-bench-")
    procs: list[Proc] = []
    try:
        urls = list(ns.replica)
        if not urls:
            ns.engine_arg = ns.engine_arg or []
            engines = [start_engine(ns, log_dir, f"engine-{i}", ns.num_blocks, i) for i in range(ns.engines)]
            procs += engines
            for e in engines:
                e.wait_ready()
            urls = [e.url for e in engines]
        common = ["--model", ns.tokenizer or ns.model, "--default-model", ns.model, "--engine-type", ns.engine_type]
        for spec in ns.vllm_kv_events:
            common += ["--vllm-kv-events", spec]
        router = start_router(log_dir, urls, common)
        picker, address = start_picker(log_dir, urls, common)
        procs += [router, picker]
        wait_all_ready(router, len(urls))
        sessions = build_sessions(ns)
        gw = Gateway(address)

        def via_picker(body, headers):
            got = gw.send("/v1/chat/completions", body, headers)
            if got.status != 200:
                raise RuntimeError(f"HTTP {got.status}: {got.body[:200]!r}")
            return got.served

        def via_router(body, headers):
            r = httpx.post(router.url + "/v1/chat/completions", json=body, headers=headers, timeout=600)
            r.raise_for_status()
            return r.headers["x-kvfleet-replica"].removeprefix("http://")

        out: dict = {"rounds": []}
        for k in range(ns.rounds):  # alternate who goes first: each starts from caches without its salt
            order = [("router", via_router), ("picker", via_picker)]
            if k % 2:
                order.reverse()
            row = {}
            for name, send in order:
                rate, served = hit_rate(send, urls, sessions, ns, f"epp-bench-{name}-{k}-{ns.seed}")
                row[name] = {"hit_rate": rate, "served": served,
                             "largest_share": max(served.values()) / max(sum(served.values()), 1)}
            out["rounds"].append(row)
        r = sum(x["router"]["hit_rate"] for x in out["rounds"]) / ns.rounds
        p = sum(x["picker"]["hit_rate"] for x in out["rounds"]) / ns.rounds
        out["summary"] = {"router_hit_rate": r, "picker_hit_rate": p, "picker_over_router": p / r,
                          "picker_largest_share": max(x["picker"]["largest_share"] for x in out["rounds"])}
        s = out["summary"]
        print(f"hit rate: picker {p:.3f} / router {r:.3f} = {s['picker_over_router']:.3f} (target >= 0.98); "
              f"largest endpoint share through the picker {s['picker_largest_share']:.2f} (target <= 0.75)")
        return out
    finally:
        for proc in reversed(procs):
            proc.stop()


# -- decision latency ------------------------------------------------------------------------------------------
def consecutive_ports(n: int) -> int:
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65000:
            continue
        socks = []
        try:
            for k in range(n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", base + k))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def _headers(pairs: dict[str, str], eos: bool = False) -> ep.HttpHeaders:
    return ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]), end_of_stream=eos)


ANSWER = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
                     "usage": {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41}}).encode()


async def one_exchange(stub, body: bytes) -> tuple[float, float]:
    """(request phase, response phase) seconds of one request's ext_proc stream, as a gateway waits on them."""
    q: asyncio.Queue = asyncio.Queue()

    async def requests():
        while (m := await q.get()) is not None:
            yield m

    call = stub.Process(requests())
    t0 = time.perf_counter()
    q.put_nowait(ep.ProcessingRequest(request_headers=_headers({":method": "POST", ":path": "/v1/chat/completions",
                                                                "content-type": "application/json"})))
    q.put_nowait(ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)))
    picked = await call.read()
    if picked.HasField("immediate_response"):
        raise RuntimeError(f"refused: {picked.immediate_response.status.code}")
    dest = next(h.header.raw_value.decode() for h in picked.request_headers.response.header_mutation.set_headers
                if h.header.key == "x-gateway-destination-endpoint")
    while not (await call.read()).request_body.response.body_mutation.streamed_response.end_of_stream:
        pass
    t_req = time.perf_counter() - t0
    md = struct_pb2.Struct()
    md.update({"x-gateway-destination-endpoint-served": dest.split(",")[0]})
    t1 = time.perf_counter()
    q.put_nowait(ep.ProcessingRequest(response_headers=_headers({":status": "200"}),
                                      metadata_context=base_pb2.Metadata(filter_metadata={"envoy.lb": md})))
    await call.read()
    q.put_nowait(ep.ProcessingRequest(response_body=ep.HttpBody(body=ANSWER, end_of_stream=True)))
    await call.read()
    t_resp = time.perf_counter() - t1
    q.put_nowait(None)
    return t_req, t_resp


async def open_loop(rate: float, duration: float, fire) -> list:
    """`fire()` at `rate` per second (Poisson arrivals) for `duration` s; the results of those that succeeded."""
    rng = random.Random(0)
    tasks, t = [], 0.0
    start = time.perf_counter()
    while t < duration:
        await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
        tasks.append(asyncio.ensure_future(fire()))
        t += rng.expovariate(rate)
    done = await asyncio.gather(*tasks, return_exceptions=True)
    return [d for d in done if not isinstance(d, BaseException)]


async def picker_latency(address: str, rate: float, duration: float) -> list[tuple[float, float]]:
    rng = random.Random(1)
    async with grpc.aio.insecure_channel(address) as ch:
        stub = ep_grpc.ExternalProcessorStub(ch)
        return await open_loop(rate, duration, lambda: one_exchange(stub, overhead_body(rng, False)))


async def http_latency(url: str, rate: float, duration: float) -> list[float]:
    rng = random.Random(1)
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=512)) as client:
        async def fire():
            t0 = time.perf_counter()
            r = await client.post(url + "/v1/chat/completions", content=overhead_body(rng, False),
                                  headers={"content-type": "application/json"})
            r.raise_for_status()
            return time.perf_counter() - t0
        return await open_loop(rate, duration, fire)


def cmd_latency(ns) -> dict:
    log_dir = tempfile.mkdtemp(prefix="epp-latency-")
    rows = []
    for n in ns.endpoints:
        base = consecutive_ports(n)
        stubs = Proc([PY, "-m", "loadtest.many_endpoints", "--ports", str(base), "--count", str(n)],
                     f"http://127.0.0.1:{base}", log_dir, f"stubs-{n}")
        procs = [stubs]
        try:
            stubs.wait_ready(60)
            urls = [f"http://127.0.0.1:{base + k}" for k in range(n)]
            common = ["--model", ns.model, "--default-model", ns.model, "--policy", ns.policy]
            router = start_router(log_dir, urls, common)
            procs.append(router)
            picker, address = start_picker(log_dir, urls, common)
            procs.append(picker)
            wait_all_ready(router, n)
            for rate in ns.rates:
                epp = asyncio.run(picker_latency(address, rate, ns.duration))
                through = asyncio.run(http_latency(router.url, rate, ns.duration))
                direct = asyncio.run(http_latency(urls[0], rate, ns.duration))
                added = [a + b for a, b in epp]
                row = {"endpoints": n, "rate": rate, "picker_requests": len(epp),
                       "picker_p50_ms": pct(added, 50) * 1e3, "picker_p99_ms": pct(added, 99) * 1e3,
                       "picker_request_phase_p50_ms": pct([a for a, _ in epp], 50) * 1e3,
                       "router_added_p50_ms": (pct(through, 50) - pct(direct, 50)) * 1e3,
                       "router_added_p99_ms": (pct(through, 99) - pct(direct, 99)) * 1e3}
                rows.append(row)
                print(f"{n:4d} endpoints {rate:6.0f} req/s: picker adds p50 {row['picker_p50_ms']:6.2f} ms, "
                      f"p99 {row['picker_p99_ms']:6.2f} ms | router adds p50 {row['router_added_p50_ms']:6.2f} ms, "
                      f"p99 {row['router_added_p99_ms']:6.2f} ms | picker/router p50 "
                      f"{row['picker_p50_ms'] / max(row['router_added_p50_ms'], 1e-3):.2f}", flush=True)
        finally:
            for proc in reversed(procs):
                proc.stop()
    return {"rows": rows}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.epp_bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("hit-rate", help="multi-turn hit rate through the picker against the HTTP router")
    h.add_argument("--engines", type=int, default=2, help="kvfleet engines to start (without --replica)")
    h.add_argument("--replica", action="append", default=[], help="an engine already running (repeatable)")
    h.add_argument("--engine-type", default="auto", choices=("auto", "kvfleet", "vllm", "sglang"))
    h.add_argument("--vllm-kv-events", action="append", default=[], metavar="SPEC")
    h.add_argument("--tokenizer", default=None, help="the router's and picker's --model (default: --model)")
    h.add_argument("--sessions", type=int, default=16)
    h.add_argument("--turns", type=int, default=4)
    h.add_argument("--system-prompts", type=int, default=4)
    h.add_argument("--system-tokens", type=int, default=256)
    h.add_argument("--mean-user-tokens", type=float, default=60)
    h.add_argument("--reply-tokens", type=int, default=None)
    h.add_argument("--max-tokens", type=int, default=16)
    h.add_argument("--concurrency", type=int, default=4)
    h.add_argument("--num-blocks", type=int, default=1024)
    h.add_argument("--rounds", type=int, default=2, help="runs of each, alternating which goes first")
    h.add_argument("--engine-module", default=None)
    h.add_argument("--threads-per-engine", type=int, default=None)
    h.add_argument("--pin-cores", action="store_true")
    h.add_argument("--engine-arg", action="append", default=[])
    lat = sub.add_parser("latency", help="what the picker adds per request, beside the HTTP router")
    lat.add_argument("--endpoints", type=_ints, default=[8, 64, 256])
    lat.add_argument("--rates", type=_ints, default=[20, 100, 400], help="open-loop requests per second")
    lat.add_argument("--duration", type=float, default=5.0, help="seconds per rate and path")
    lat.add_argument("--policy", default="kv")
    for q in (h, lat):
        q.add_argument("--model", default="smollm2")
        q.add_argument("--seed", type=int, default=0)
        q.add_argument("--json", default=None, help="write the figures to this file")
    ns = p.parse_args(argv)
    out = cmd_hit_rate(ns) if ns.cmd == "hit-rate" else cmd_latency(ns)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

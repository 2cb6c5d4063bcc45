"""Many stub engine endpoints in one process (`python -m loadtest.many_endpoints --ports 20000 --count 256`): each
port answers like an idle engine - /ready and /health 200, /metrics with the vLLM metric names (nothing running),
/v1/models listing the model, no KV event stream (404), and chat/completions at once with a short JSON answer and
its usage. For measuring what a router or picker adds per request at 8 to 256 endpoints, where one fake engine
process per endpoint would not fit on the machine."""

from __future__ import annotations

import argparse
import asyncio
import time

from aiohttp import web

METRICS = ("vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.1\n"
           "vllm:prefix_cache_queries_total 0\nvllm:prefix_cache_hits_total 0\n")


def make_app(model: str) -> web.Application:
    async def ok(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=METRICS, content_type="text/plain")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model"}]})

    async def completion(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({
            "id": "stub", "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41}})

    app = web.Application()
    app.router.add_get("/ready", ok)
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", completion)
    app.router.add_post("/v1/completions", completion)
    return app


async def serve(host: str, first_port: int, count: int, model: str) -> None:
    runner = web.AppRunner(make_app(model), access_log=None)
    await runner.setup()
    for port in range(first_port, first_port + count):
        await web.TCPSite(runner, host, port).start()
    print(f"{count} endpoints on {host}:{first_port}..{first_port + count - 1}", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.many_endpoints", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--ports", type=int, required=True, help="the first port (then one per endpoint)")
    p.add_argument("--count", type=int, default=8)
    p.add_argument("--model", default="smollm2")
    ns = p.parse_args(argv)
    if ns.count < 1 or not 1 <= ns.ports <= 65535 - ns.count:
        p.error("--ports and --count must name ports in 1..65535")
    asyncio.run(serve(ns.host, ns.ports, ns.count, ns.model))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


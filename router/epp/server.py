"""`kvfleet epp`'s gRPC server: Envoy's ExternalProcessor (one PickStream per HTTP request) and the gRPC health
service (`liveness`, `readiness`, `envoy.service.ext_proc.v3.ExternalProcessor`), over one RouterCore.

Readiness follows the endpoints: SERVING while a request can be placed (a ready endpoint, the tokenizer there),
NOT_SERVING otherwise and while draining; liveness is SERVING as long as the process answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from router.config import RouterConfig
from router.epp.stream import PickerSettings, PickStream
from router.requests.core import RouterCore
from router.requests.flow import Flow

log = logging.getLogger("kvfleet.epp")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
READINESS = ("readiness", EXT_PROC_SERVICE)
READINESS_INTERVAL_S = 0.25


class Processor(ep_grpc.ExternalProcessorServicer):
    def __init__(self, picker: Picker):
        self.picker = picker

    async def Process(self, request_iterator, context):  # noqa: N802 (the gRPC method's name)
        async for response in PickStream(self.picker.core, self.picker.flow, self.picker.settings).run(
                request_iterator):
            yield response


class Picker:
    """The endpoint picker: one RouterCore, its gRPC server and the readiness it reports."""

    def __init__(self, cfg: RouterConfig, settings: PickerSettings | None = None, tokenizer=None):
        self.cfg = cfg
        self.core = RouterCore(cfg, tokenizer)
        self.flow = Flow(self.core)
        self.settings = settings or PickerSettings()
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.draining = False
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._watch: asyncio.Task | None = None
        self._http: web.AppRunner | None = None

    def not_serving(self) -> str | None:
        return self.core.not_serving(self.draining)

    async def start(self, metrics_port: int | None = None) -> int:
        """Start the core and serve on cfg.host:cfg.port (0: a free port), and /metrics and /ready over HTTP on
        `metrics_port` (None: not at all); the gRPC port it listens on."""
        await self.core.start()
        server = self.server = grpc.aio.server()
        ep_grpc.add_ExternalProcessorServicer_to_server(Processor(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.port = server.add_insecure_port(f"{self.cfg.host}:{self.cfg.port}")
        if not self.port:
            raise OSError(f"cannot listen on {self.cfg.host}:{self.cfg.port}")
        await self._set("liveness", True)
        for name in READINESS:
            await self._set(name, False)
        await server.start()
        self._watch = asyncio.create_task(self._readiness_loop())
        if metrics_port is not None:
            await self._serve_metrics(metrics_port)
        log.info("endpoint picker listening on %s:%d", self.cfg.host, self.port)
        return self.port

    async def _serve_metrics(self, port: int) -> None:
        async def metrics(_: web.Request) -> web.Response:
            return web.Response(body=self.core.metrics.render(),
                                headers={"content-type": "text/plain; version=0.0.4; charset=utf-8"})

        async def ready(_: web.Request) -> web.Response:
            why = self.not_serving()
            return web.json_response({"status": why or "ready"}, status=503 if why else 200)

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/ready", ready)
        self._http = web.AppRunner(app, access_log=None)
        await self._http.setup()
        site = web.TCPSite(self._http, self.cfg.host, port)
        await site.start()
        self.metrics_port = port

    async def _set(self, service: str, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        got = self.health.set(service, status)
        if asyncio.iscoroutine(got):
            await got

    async def _readiness_loop(self) -> None:
        ready: bool | None = None
        while True:
            why = self.not_serving()
            if (why is None) != ready:
                ready = why is None
                for name in READINESS:
                    await self._set(name, ready)
                log.info("endpoint picker is %s", "ready" if ready else f"NOT ready ({why})")
            await asyncio.sleep(READINESS_INTERVAL_S)

    async def drain(self, timeout: float) -> None:
        """SIGTERM: readiness turns NOT_SERVING (the gateway stops asking), streams in flight finish for up to
        `timeout` s."""
        self.draining = True
        for name in READINESS:
            await self._set(name, False)
        if self.server is not None:
            await self.server.stop(timeout)

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self.server is not None:
            await self.server.stop(0)
        if self._http is not None:
            await self._http.cleanup()
        await self.core.stop()

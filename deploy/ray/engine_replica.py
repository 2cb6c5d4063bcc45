"""The engine deployment's replica: one kvfleet engine behind the engine's own FastAPI app (engine/server/app.py),
called in-process (asgi_call.py) instead of over a socket.

Methods the Serve application calls through a DeploymentHandle:
- `generate(method, path, body, headers, route=...)`: one OpenAI request; yields the response Head (with
  `x-kvfleet-replica: <replica id>`), then its body chunks (SSE for streams). `route` is the ingress's RouteHint,
  read by the request router, ignored here.
- `metrics(replica=ID)`: the engine's /metrics text, pinned to one replica (request_router.py).
- `kv_events()`: the engine's GET /v1/kv/events stream (contract/kv_wire.py NDJSON lines: snapshot, live events,
  heartbeats), which every request router subscribes to (kv_subscription.py).
Methods Serve itself calls: `record_routing_stats` (load for the request routers), `record_autoscaling_stats`
(KV usage and waiting requests for autoscaling.py), `check_health` (a dead engine loop fails the replica).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping

from contract.errors import ConfigError
from deploy.ray.asgi_call import Head, Lifespan, call

log = logging.getLogger("kvfleet.ray.engine")

REPLICA_HEADER = "x-kvfleet-replica"


def replica_id() -> str:
    """This Serve replica's unique id (the instance id in its KV events), or a local one outside Serve."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not inside a Serve replica (tests)
        import uuid

        return uuid.uuid4().hex[:8]


def load_app_factory(spec: str) -> Callable:
    """The function a "module:function" string names (RayAppConfig.app_factory): called as
    function(instance_id, **app_options), it returns the ASGI app a replica serves instead of an engine (the
    overhead benchmark passes loadtest's fake engine). A ConfigError says what is wrong with the string."""
    module, sep, name = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not (sep and module and name.isidentifier()):
        raise ConfigError("app_factory", f"app_factory must be a 'module:function' string, got {spec!r}")
    try:
        found = getattr(importlib.import_module(module), name, None)
    except ImportError as e:
        raise ConfigError("app_factory", f"app_factory {spec!r}: cannot import {module}: {e}") from None
    if not callable(found):
        raise ConfigError("app_factory", f"app_factory {spec!r}: {module} has no function {name}")
    return found


class EngineReplica:
    async def __init__(self, engine: Mapping | None = None, sse_keepalive: float = 10.0,
                       app_factory: str | None = None, app_options: Mapping | None = None):
        from engine.args import EngineArgs
        from engine.server.app import build_app
        from engine.server.serving import ServerConfig

        self.id = replica_id()
        if app_factory is not None:  # no engine: the app that function builds (benchmarks)
            self.app, self.state = load_app_factory(app_factory)(self.id, **dict(app_options or {})), None
            self.lifespan = Lifespan(self.app)
            await self.lifespan.start()
            return
        args = EngineArgs(**dict(engine or {}))
        config = ServerConfig(served_model_names=(args.served_model_name or args.model,), instance_id=self.id,
                              sse_keepalive=sse_keepalive)

        def make_engine():
            from engine.async_engine import AsyncLLMEngine

            return AsyncLLMEngine(args)

        self.app = build_app(config, engine_factory=make_engine)
        self.state = self.app.state.server
        self.lifespan = Lifespan(self.app)
        await self.lifespan.start()
        while not self.state.ready:  # Serve routes to a replica once __init__ returns: wait for the model
            if self.state.load_error:
                raise RuntimeError(f"engine failed to load: {self.state.load_error}")
            await asyncio.sleep(0.1)
        log.info("engine replica %s ready (%s)", self.id, config.model_name)

    async def generate(self, method: str, path: str, body: bytes = b"", headers: Mapping[str, str] | None = None,
                       route=None) -> AsyncIterator[Head | bytes]:
        async for item in call(self.app, method, path, body, headers):
            if isinstance(item, Head):
                item = Head(item.status, (*item.headers, (REPLICA_HEADER, self.id)))
            yield item

    async def kv_events(self) -> AsyncIterator[bytes]:
        async for item in call(self.app, "GET", "/v1/kv/events"):
            if isinstance(item, Head):
                if item.status != 200:
                    raise RuntimeError(f"KV events of replica {self.id}: HTTP {item.status}")
                continue
            yield item

    async def metrics(self, replica: str | None = None) -> str:
        """The engine's Prometheus text (GET /metrics); `replica` is the request router's pin, unused here."""
        out = [x async for x in call(self.app, "GET", "/metrics")]
        return b"".join(x for x in out if isinstance(x, bytes)).decode()

    def _stats(self):
        eng = self.state.engine if self.state is not None else None
        return eng.stats() if eng is not None else None

    async def record_routing_stats(self) -> dict:
        s = self._stats()
        if s is None:
            return {}
        capacity = s.num_total_blocks * s.block_size
        return {"kv_usage": s.kv_usage, "kv_tokens": s.kv_usage * capacity, "kv_capacity_tokens": capacity,
                "running": s.num_running, "waiting": s.num_waiting}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        s = self._stats()
        if s is None:
            return {}
        return {"kv_usage": float(s.kv_usage), "waiting": float(s.num_waiting)}

    def check_health(self) -> None:
        if self.state is not None and self.state.engine_dead:
            raise RuntimeError(f"engine loop died: {self.state.engine.dead}")

    async def __del__(self):
        await self.lifespan.stop()

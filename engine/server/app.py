"""The FastAPI app of one engine replica: OpenAI API, health/readiness, metrics, KV event stream.

`build_app(config, engine=...)` serves an engine that is already built; `engine_factory=` builds it
in a worker thread after the server is up, so /health answers (and /ready says no) while the model
loads. `drain(state)` is what SIGTERM runs: /ready turns false, new requests get 503, running ones
finish until the drain timeout, then whatever is left is aborted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from contract.kv_transfer import PATH
from contract.usage_lookup import PATH as USAGE_LOOKUP_PATH
from engine.server.auth import InternalTokenGuard
from engine.server.chat import create_chat_completion
from engine.server.completions import create_completion
from engine.server.errors import error_response, install_error_handlers
from engine.server.kv_events import check_internal_token, kv_events
from engine.server.kv_transfer import KVPuller, kv_blocks
from engine.server.lora import LoRARegistry, load_lora_adapter, model_cards, unload_lora_adapter
from engine.server.metrics import EngineMetrics
from engine.server.protocol import ChatCompletionRequest, CompletionRequest
from engine.server.serving import ServerConfig, ServerState
from engine.server.usage import usage_lookup
from engine.tokenizer import tokenizer_archive

logger = logging.getLogger("kvfleet.server")


class BodyLimit:
    """413 for bodies over max_bytes, by Content-Length up front or by counting a chunked body."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_big = error_response(413, f"request body exceeds the limit of {self.max_bytes} bytes", None,
                                 "request_too_large", {"Connection": "close"})
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                await error_response(400, "invalid Content-Length header", None, "invalid_header")(scope, receive, send)
                return
            if int(length) > self.max_bytes:
                await too_big(scope, receive, send)
                return
        seen = 0
        started = False

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise StarletteHTTPException(413, f"request body exceeds the limit of {self.max_bytes} bytes")
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except StarletteHTTPException as e:
            if e.status_code != 413 or started:
                raise
            await too_big(scope, receive, send)


def build_app(config: ServerConfig, engine=None, engine_factory: Callable[[], object] | None = None,
              metrics: EngineMetrics | None = None, on_load_error: Callable[[str], None] | None = None,
              on_engine_dead: Callable[[str], None] | None = None, lora: LoRARegistry | None = None) -> FastAPI:
    """lora: the LoRA adapters served (engine/server/lora.py), None when LoRA is off.
    on_load_error / on_engine_dead: called (once) when the model fails to load / the engine loop dies;
    main() exits non-zero then, so a supervisor restarts the replica instead of keeping a zombie."""
    state = ServerState(config, None)
    state.lora = lora
    metrics = metrics or EngineMetrics(config.model_name, stats=lambda: state.engine.stats() if state.engine else None,
                                       extra_info=lambda: {"instance_id": config.instance_id})
    if config.kv_pull_timeout > 0:
        state.kv_puller = KVPuller(state, metrics, config.kv_pull_timeout, config.kv_pull_max_bytes)

    async def load() -> None:
        try:
            eng = engine if engine is not None else await asyncio.to_thread(engine_factory)
            await eng.start()
            if hasattr(eng, "usage_sink"):  # every delta its core reports: what each request used
                eng.usage_sink = state.usage
            state.engine = eng
            logger.info("engine ready: model %s, max_model_len %s", config.model_name, eng.limits.max_model_len)
        except Exception as e:  # report it on /ready and let main() decide to exit
            logger.exception("engine failed to start")
            state.load_error = f"{type(e).__name__}: {e}"
            if on_load_error:
                on_load_error(state.load_error)
            return
        while not state.closing:  # watchdog: /health and /ready turn 503 at once; main() exits
            await asyncio.sleep(0.5)
            if state.engine_dead:
                logger.error("engine loop died: %s", state.engine.dead)
                if on_engine_dead:
                    on_engine_dead(f"engine loop died: {state.engine.dead}")
                return

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = asyncio.ensure_future(load())
        try:
            yield
        finally:
            state.closing = True
            if not loader.done():
                loader.cancel()
            if state.kv_puller is not None:
                await state.kv_puller.close()
            if state.engine is not None:
                await state.engine.shutdown()

    app = FastAPI(title="kvfleet engine", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API of one kvfleet engine replica.")
    app.state.server = state
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    if config.require_internal_token:  # added last: the outermost layer, before the body is read
        app.add_middleware(InternalTokenGuard, token=config.internal_token)

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.engine_dead and not state.closing:  # liveness: a dead engine loop needs a restart
            return JSONResponse({"status": "engine_dead", "error": str(state.engine.dead)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if state.ready:
            return JSONResponse({"ready": True})
        reason = ("draining" if state.draining else "engine_dead" if state.engine_dead
                  else "load_failed" if state.load_error else "loading")
        return JSONResponse({"ready": False, "reason": reason}, status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        eng = state.engine_or_503()  # 503 + Retry-After until a chat request could succeed
        data = [{"id": name, "object": "model", "created": state.created, "owned_by": "kvfleet",
                 "root": config.model_name, "parent": None, "max_model_len": eng.limits.max_model_len}
                for name in config.served_model_names]
        data += model_cards(state, state.created, eng.limits.max_model_len)
        return {"object": "list", "data": data}

    @app.post("/v1/load_lora_adapter")
    async def load_lora(request: Request) -> Response:
        return await load_lora_adapter(state, request)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(request: Request) -> Response:
        return await unload_lora_adapter(state, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(state, body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(state, body, request)

    @app.get("/v1/kv/events")
    async def events(request: Request) -> Response:
        return await kv_events(state, request)

    @app.post(PATH)
    async def blocks(request: Request) -> Response:
        return await kv_blocks(state, request)

    @app.post(USAGE_LOOKUP_PATH)
    async def usage(request: Request) -> Response:
        return await usage_lookup(state, request)

    @app.get("/v1/kvfleet/tokenizer")
    async def tokenizer_files(request: Request) -> Response:
        """The tokenizer's files as a tar (engine/tokenizer.py), for routers that have no model files."""
        check_internal_token(state, request)
        eng = state.engine_or_503()
        data = await asyncio.to_thread(tokenizer_archive, eng.tokenizer)
        return Response(data, media_type="application/x-tar")

    return app


async def drain(state: ServerState, timeout: float) -> None:
    """Stop taking requests, let running ones finish for up to `timeout` s, abort the rest."""
    state.draining = True
    logger.info("draining: %d requests in flight, up to %.1f s", len(state.inflight), timeout)
    if not await state.inflight.wait_empty(timeout):
        left = list(state.inflight.ids)
        logger.warning("drain timeout: aborting %d requests", len(left))
        for rid in left:
            try:
                await state.engine.abort(rid)
            except Exception:
                logger.debug("abort of %s failed", rid, exc_info=True)
        await state.inflight.wait_empty(2.0)
    state.closing = True
    logger.info("drained")

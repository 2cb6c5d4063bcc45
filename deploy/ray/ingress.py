"""The OpenAI-compatible ingress of the Serve application: takes /v1/chat/completions and /v1/completions
(streaming or not) and /v1/models, prepares each request once as the HTTP router does (router/routing/prepare.py: the
engines' tokenizer and chat template, router/routing/tokens.py piece cache, chained block hashes for the fleet's block
size and hash seed) and hands it to the engine deployment with that RouteHint; the request router
(request_router.py) picks the replica. The engine's response (its status, headers, body, SSE stream) comes back
unchanged, with `x-kvfleet-replica` naming the replica that served it.
"""

import asyncio
import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from contract.errors import error_body, error_type
from contract.request import Endpoint, RequestError, parse_request
from deploy.ray.asgi_call import Head
from deploy.ray.route_hint import RouteHint
from router.routing.prepare import CHAT_PATH, COMPLETIONS_PATH, prepare_request

log = logging.getLogger("kvfleet.ray.ingress")

FORWARDED_HEADERS = ("content-type", "x-session-id", "x-request-id", "accept")
DROPPED_RESPONSE_HEADERS = ("content-length", "transfer-encoding", "connection", "x-request-id")  # Serve sets its own

api = FastAPI(title="kvfleet on Ray Serve", description="OpenAI-compatible API in front of kvfleet engine replicas.")


@serve.ingress(api)  # at import: a replica that imports this module gets the same class-based routes
class Ingress:
    """`engine_handle`: the EngineReplica deployment; `engine`: its EngineArgs fields (model, block size, seed)."""

    def __init__(self, engine_handle, engine: Mapping | None = None, need_tokens: bool = True):
        from contract.hashing import DEFAULT_HASH_SEED
        from engine.tokenizer import load_tokenizer
        from router.routing.tokens import PromptTokenizer

        engine = dict(engine or {})
        self.engine = engine_handle
        self.block_size = int(engine.get("block_size", 16))
        self.hash_seed = int(engine.get("hash_seed", DEFAULT_HASH_SEED))
        self.need_tokens = need_tokens
        self.tokenizer = PromptTokenizer(load_tokenizer(engine.get("model", "smollm2"))) if need_tokens else None

    def hint(self, path: str, raw: bytes, headers: Mapping[str, str]) -> RouteHint | JSONResponse:
        """The routing hint of a request, parsed once as the HTTP router parses it (contract/request.py), or
        the same 400 the HTTP router answers."""
        try:
            req = parse_request(Endpoint(path), raw)
        except RequestError as e:
            return JSONResponse(error_body(str(e), error_type(e.status), e.param, e.code), status_code=e.status)
        prep = prepare_request(path, req.body, headers, self.tokenizer, self.need_tokens)
        return RouteHint.of(prep, self.block_size, self.hash_seed)

    async def forward(self, method: str, path: str, raw: bytes, request: Request,
                      hint: RouteHint | None = None) -> Response:
        headers = {k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k)) is not None}
        gen = self.engine.options(stream=True).generate.remote(method, path, raw, headers, route=hint)
        try:
            head = await gen.__anext__()
        except StopAsyncIteration:
            return JSONResponse(error_body("the engine replica sent no response", error_type(502), None, "no_response"),
                                status_code=502)
        if not isinstance(head, Head):
            gen.cancel()
            raise RuntimeError(f"engine replica answered {type(head).__name__} before its response head")
        out_headers = {k: v for k, v in head.headers if k not in DROPPED_RESPONSE_HEADERS}

        async def body():
            try:
                async for chunk in gen:
                    yield chunk
            except asyncio.CancelledError:  # the client went away: the engine aborts the request
                gen.cancel()
                raise

        return StreamingResponse(body(), status_code=head.status, headers=out_headers,
                                 media_type=out_headers.pop("content-type", None))

    @api.post(CHAT_PATH)
    async def chat(self, request: Request) -> Response:
        raw = await request.body()
        hint = self.hint(CHAT_PATH, raw, request.headers)
        if isinstance(hint, JSONResponse):
            return hint
        return await self.forward("POST", CHAT_PATH, raw, request, hint)

    @api.post(COMPLETIONS_PATH)
    async def completions(self, request: Request) -> Response:
        raw = await request.body()
        hint = self.hint(COMPLETIONS_PATH, raw, request.headers)
        if isinstance(hint, JSONResponse):
            return hint
        return await self.forward("POST", COMPLETIONS_PATH, raw, request, hint)

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        return await self.forward("GET", "/v1/models", b"", request)

    def __del__(self):
        """Serve's graceful shutdown of this ingress: end its request router's KV event subscriptions, which
        would otherwise hold every engine replica in its drain until the graceful shutdown timeout."""
        from deploy.ray.routing_state import close_all

        close_all()

    @api.get("/health")
    async def health(self) -> JSONResponse:
        return JSONResponse({"status": "ok"})

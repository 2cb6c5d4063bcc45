"""The router's ASGI app: OpenAI endpoints proxied to the fleet, plus /health, /ready, /metrics.

A plain ASGI callable (no framework) keeps the per-request path short: read the body, tokenize and hash,
score, then stream through. Discovery, health checks, scrapes and KV event streams run as background tasks
started by the ASGI lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from functools import partial

from contract.errors import error_body, error_type
from contract.token_ids import RETURN_TOKEN_IDS
from router.config import RouterConfig
from router.http.disagg import prefill, pull_from
from router.http.migrate import Resume
from router.http.models import fleet_models, listed_models
from router.http.proxy import Attempts, Proxy, forward_headers
from router.http.responses import send_bytes, send_json
from router.migration.continuation import why_not
from router.refusal import Refusal
from router.requests.core import RouterCore
from router.requests.flow import Entry, Flow, Outcome
from router.routing.prepare import CHAT_PATH, COMPLETIONS_PATH
from router.tenants.ledger import USAGE_PATH

log = logging.getLogger("kvfleet.router")
access_log = logging.getLogger("kvfleet.router.access")

_PROXIED = (CHAT_PATH, COMPLETIONS_PATH)
_GET_PATHS = ("/v1/models", "/health", "/ready", "/metrics", USAGE_PATH)
_UNLOGGED = ("/health", "/ready", "/metrics")  # probes and scrapes stay out of the access log
_SHUTDOWN_S = 10.0
_GONE = object()  # the client went away while its request waited in the fair queue


class RouterApp:
    def __init__(self, cfg: RouterConfig, tokenizer=None):
        self.cfg = cfg
        self.core = core = RouterCore(cfg, tokenizer)  # fleet, pools, tenants, admission, gate, tokenizers
        self.flow = Flow(core)
        self.metrics, self.fleet, self.pools, self.admission = core.metrics, core.fleet, core.pools, core.admission
        self.proxy: Proxy | None = None
        self.draining = False
        self.inflight = 0  # completion requests being served
        self._idle = asyncio.Event()
        self._idle.set()

    # -- lifecycle -----------------------------------------------------------------------------------------
    async def startup(self) -> None:
        # the tokenizer also reads the text a failed replica held back (migrations)
        await self.core.start(wants_tokenizer=self.cfg.max_migrations > 0)
        self.proxy = Proxy(self.metrics, self.core.session, self.cfg.max_attempts, self.cfg.internal_token,
                           own_credentials=self.core.ratelimit is not None)

    def not_serving(self) -> str | None:
        """Why a chat through this router cannot succeed now (None: it can): /ready and /v1/models say so."""
        return self.core.not_serving(self.draining)

    async def drain(self, timeout: float) -> None:
        """SIGTERM: /ready turns 503 (load balancers stop sending here), new completion requests get 503 +
        Retry-After, running ones (streams too) finish for up to `timeout` s."""
        self.draining = True
        log.info("draining: %d requests in flight, up to %.1f s", self.inflight, timeout)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            log.info("drained")
        except TimeoutError:
            log.warning("drain timeout: %d requests still running are cut", self.inflight)

    async def shutdown(self) -> None:
        await self.core.stop()

    # -- ASGI ----------------------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as e:  # report it: uvicorn exits with the message
                    log.exception("router startup failed")
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                # bounded: a background task stuck on a dead peer must not keep the process from exiting
                done, _ = await asyncio.wait({asyncio.ensure_future(self.shutdown())}, timeout=_SHUTDOWN_S)
                if not done:
                    log.warning("shutdown did not finish within %.0f s; exiting anyway", _SHUTDOWN_S)
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope, receive, send) -> None:
        if not self.cfg.access_log or scope["path"] in _UNLOGGED:
            await self._serve(scope, receive, send, Attempts())
            return
        t0 = time.perf_counter()
        status = "-"  # the client went away before a response started

        async def send_logged(msg) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = str(msg["status"])
            await send(msg)

        attempts = Attempts()
        try:
            await self._serve(scope, receive, send_logged, attempts)
        finally:
            access_log.info("%s %s %s replica=%s latency_ms=%.1f cached_tokens=%d retries=%d migrations=%d",
                            scope["method"], scope["path"], status, attempts.replica or "-",
                            (time.perf_counter() - t0) * 1000, attempts.predicted_cached_tokens, attempts.retries,
                            attempts.resume.migrations if attempts.resume is not None else 0)

    async def _serve(self, scope, receive, send, attempts: Attempts) -> None:
        path, method = scope["path"], scope["method"]
        if path in _PROXIED:
            if method != "POST":
                await send_json(send, 405, error_body(f"{path} takes POST", error_type(405)))
                return
            if self.draining:
                await send_json(send, 503, error_body("this router is shutting down; retry (another router "
                                                      "takes it)", error_type(503), None, "draining"),
                                [(b"retry-after", b"1")])
                return
            self.inflight += 1
            self._idle.clear()
            try:
                await self._completion(scope, receive, send, path, attempts)
            finally:
                self.inflight -= 1
                if self.inflight == 0:
                    self._idle.set()
            return
        if path in _GET_PATHS:
            if method not in ("GET", "HEAD"):
                await send_json(send, 405, error_body(f"{path} takes GET", error_type(405)))
            elif path == "/health":
                await send_json(send, 200, {"status": "ok"})
            elif path == "/ready":
                why = self.not_serving()
                n = len(self.fleet.ready_urls())
                counts = {"ready_replicas": n, "replicas": len(self.fleet.replicas)}
                await send_json(send, 503 if why else 200, {"status": why or "ready",
                                                            **(counts if why in (None, "no ready replica") else {})})
            elif path == "/metrics":
                await send_bytes(send, 200, self.metrics.render(), b"text/plain; version=0.0.4; charset=utf-8")
            elif path == USAGE_PATH:
                await self._usage(send, scope["headers"], scope.get("query_string", b""))
            else:
                await self._models(send, scope["headers"])
            return
        await send_json(send, 404, error_body(f"no route for {method} {path}", error_type(404)))

    async def _usage(self, send, headers, query: bytes) -> None:
        """The caller's own usage in OpenAI's shape (router/tenants/ledger.py), from the usage ledger."""
        tenant = self.admission.identify(headers)
        if isinstance(tenant, Refusal):
            await send_json(send, tenant.status, tenant.body, tenant.headers)
        elif tenant is None or self.core.ratelimit is None:
            await send_json(send, 404, error_body("usage is metered per tenant: this router runs without a tenants "
                                                  "file (--tenants)", error_type(404), None, "not_found"))
        else:
            await send_json(send, *await self.core.ratelimit.usage(tenant, query.decode("latin-1")))

    async def _models(self, send, headers) -> None:
        """Every model the ready replicas serve, once each, with the LoRA adapters of those models the replicas list
        or a pool loads on demand (those the caller's tenant may use); 503 +
        Retry-After until a chat can succeed (so a client polling /v1/models for readiness never sees 200 too
        early)."""
        tenant = self.admission.identify(headers)
        if isinstance(tenant, Refusal):
            await send_json(send, tenant.status, tenant.body, tenant.headers)
            return
        why = self.not_serving()
        served = self.pools.catalog.pools_of
        models = [] if why else listed_models(
            await fleet_models(self.core.session, self.fleet.ready_urls(), self.core.internal_headers), served,
            {pc.spec.name: pc.spec for pc in self.pools.config.pools},
            lambda pools: any(self.fleet.ready_urls(p) for p in pools))
        if tenant is not None and tenant.models is not None:
            models = [m for m in models if m["id"] in tenant.models]
        if not models and why is None and served and tenant is not None and tenant.models is not None:
            await send_json(send, 200, {"object": "list", "data": []})  # nothing this key may use
            return
        if not models:
            await send_json(send, 503, error_body(f"no model to list yet ({why or 'no replica lists one'}); retry",
                                                  error_type(503), None, "no_ready_replica"),
                            [(b"retry-after", b"1")])
            return
        await send_json(send, 200, {"object": "list", "data": models})

    async def _read_body(self, receive) -> bytes | None:
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.cfg.max_body_bytes:
                raise ValueError(f"request body is larger than {self.cfg.max_body_bytes} bytes")
            chunks.append(chunk)
            if not msg.get("more_body"):
                return b"".join(chunks)

    async def _completion(self, scope, receive, send, path: str, attempts: Attempts) -> None:
        try:
            raw = await self._read_body(receive)
        except ValueError as e:
            await send_json(send, 413, error_body(str(e), error_type(413), None, "request_too_large"))
            return
        if raw is None:
            return
        headers = scope["headers"]
        entry = await self.flow.admit(path, raw, headers)
        if isinstance(entry, Refusal):
            await send_json(send, entry.status, entry.body, entry.headers)
            return
        try:
            got = await self._queued(receive, self.flow.queue(entry))  # a full pool: wait in its fair queue
            if got is _GONE:  # the client went away while queued: nothing reached an engine
                return
            if isinstance(got, Refusal):
                await send_json(send, got.status, got.body, got.headers)
                return
            await self._send_upstream(send, receive, headers, entry, attempts)
        finally:
            await self.flow.finish(entry, Outcome(attempts.status, attempts.usage, attempts.answered,
                                                  attempts.first_token_at, attempts.ended_at, attempts.no_replica,
                                                  attempts.replica))

    async def _send_upstream(self, send, receive, headers, entry: Entry, attempts: Attempts) -> None:
        req = self.flow.upstream(entry)
        headers = self.flow.upstream_headers(entry, headers)
        attempts.follower = entry.follower
        attempts.sending = partial(self.flow.sending, entry)
        pool, path, prep = entry.pool, entry.path, entry.prep
        if self.cfg.max_migrations and req.stream and why_not(req) is None \
                and self.fleet.engine_of(pool.name).kind != "sglang":  # SGLang sends no token ids
            # a stream that may move to another replica if its own fails (router/http/migrate.py): the engine
            # sends the token ids a continuation starts from; the client gets them only if it asked
            keep = req.get(RETURN_TOKEN_IDS) is True
            if not keep:
                req = req.with_fields(**{RETURN_TOKEN_IDS: True})
            attempts.resume = Resume(req, pool.name, keep, self.core.tokenizers.get(req.model), self.cfg.max_migrations)
        body = req.upstream_body()  # written once, here
        source = None  # with disaggregation: the replica that prefilled the prompt
        if pool.role == "decode" and (prefill_pool := self.pools.prefill_pool(req.model)) is not None:
            source = await prefill(self.proxy.session, self.fleet, self.metrics, path, req, prep, prefill_pool,
                                   forward_headers(headers, self.cfg.internal_token, self.proxy.own_credentials))

        def lease(p, tried):
            return pull_from(self.flow.lease(entry, tried), source, p.num_prompt_tokens)

        await self._forward(send, receive, path, body, headers, prep, lease, attempts, entry.headers)

    @staticmethod
    async def _queued(receive, entering):
        """The gate's answer (None: let through), or _GONE when the client disconnects first (the wait is
        cancelled)."""
        work = asyncio.ensure_future(entering)
        disconnect = asyncio.ensure_future(_wait_disconnect(receive))
        await asyncio.wait((work, disconnect), return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            return _GONE
        disconnect.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await disconnect
        return work.result()

    async def _forward(self, send, receive, path, body, headers, prep, lease, attempts, extra) -> None:
        metrics = self.metrics
        work = asyncio.ensure_future(self.proxy.forward(send, path, body, headers, prep, lease, attempts, extra))
        disconnect = asyncio.ensure_future(_wait_disconnect(receive))
        await asyncio.wait((work, disconnect), return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # the client went away: cancelling closes the upstream stream, the engine aborts
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
            metrics.requests.labels("any", metrics.policy, "cancelled").inc()
            return
        disconnect.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await disconnect
        exc = work.exception()
        if exc is not None and not isinstance(exc, OSError):
            log.error("proxy failed", exc_info=exc)


async def _wait_disconnect(receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return

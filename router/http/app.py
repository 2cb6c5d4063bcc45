"""The router's ASGI app: OpenAI endpoints proxied to the fleet, plus /health, /ready, /metrics.

A plain ASGI callable (no framework) keeps the per-request path short: read the body, tokenize and hash,
score, then stream through. Discovery, health checks, scrapes and KV event streams run as background tasks
started by the ASGI lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time

import aiohttp

from contract.errors import error_body, error_type
from contract.request import Endpoint, RequestError, parse_request
from contract.structured import constrained_kind
from contract.token_ids import RETURN_TOKEN_IDS
from router.admission.fair_queue import FairQueueConfig
from router.admission.gate import Gate, Pass
from router.admission.pipeline import Admission
from router.config import RouterConfig
from router.http.disagg import prefill, pull_from
from router.http.migrate import Resume
from router.http.models import fleet_models, listed_models
from router.http.proxy import Attempts, Proxy, forward_headers
from router.http.responses import send_bytes, send_json
from router.http.tokenizers import THIRD_PARTY, Tokenizers
from router.http.usage import StreamUsage, ask_for_usage
from router.metrics import RouterMetrics
from router.migration.continuation import why_not
from router.pools.control import Pools
from router.refusal import Refusal
from router.routing.adapters import AdapterLoader
from router.routing.fleet import Fleet
from router.routing.prepare import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    PreparedRequest,
    prepare_request,
    prompt_token_counts,
)
from router.routing.tokens import PromptTokenizer
from router.tenants.ratelimit import RateLimiter

log = logging.getLogger("kvfleet.router")
access_log = logging.getLogger("kvfleet.router.access")

_PROXIED = (CHAT_PATH, COMPLETIONS_PATH)
_GET_PATHS = ("/v1/models", "/health", "/ready", "/metrics")
_UNLOGGED = ("/health", "/ready", "/metrics")  # probes and scrapes stay out of the access log
_SHUTDOWN_S = 10.0


class RouterApp:
    def __init__(self, cfg: RouterConfig, tokenizer=None):
        self.cfg = cfg
        self.metrics = RouterMetrics(cfg.policy)
        self.fleet = Fleet(cfg, self.metrics)
        self.metrics.attach(self.fleet)
        self.tokenizers = Tokenizers(tokenizer)
        # engine pools and tenants (a bad pools or tenants file raises here, before the router serves)
        self.pools = Pools(cfg, self.fleet, self.metrics)
        self.ratelimit = (RateLimiter(cfg.ratelimit, self.metrics, self.fleet.load, cfg.request_timeout_s)
                          if cfg.ratelimit.tenants_file else None)
        self.admission = Admission(self.pools, self.ratelimit, self.metrics, cfg.ratelimit.shedding, cfg.default_model)
        self.gate = (Gate(FairQueueConfig(max_per_tenant=cfg.queue_max_per_tenant, max_total=cfg.queue_max_total,
                                          timeout_s=cfg.queue_timeout_s),
                          lambda pool: self.fleet.room(pool, cfg.replica_slots), self.metrics,
                          seats=(lambda pool: self.fleet.seats(pool, cfg.replica_slots)) if cfg.forward_priority
                          else None)
                     if cfg.replica_slots > 0 else None)
        self.need_tokens = (self.fleet.policy.needs.prompt_tokens or self.ratelimit is not None
                            or cfg.pools_file is not None or self.gate is not None)
        self.proxy: Proxy | None = None
        self.session: aiohttp.ClientSession | None = None
        self.draining = False
        self.inflight = 0  # completion requests being served
        self._idle = asyncio.Event()
        self._idle.set()
        self._internal_headers = {"authorization": f"Bearer {cfg.internal_token}"} if cfg.internal_token else {}
        self.adapters = AdapterLoader(self.fleet, lambda: self.session, self._internal_headers, self.metrics)  # LoRA

    # -- lifecycle -----------------------------------------------------------------------------------------
    async def startup(self) -> None:
        cfg = self.cfg
        toks = self.tokenizers
        # the tokenizer: to count and hash prompts, and to read the text a failed replica held back (migrations)
        wants_tokenizer = self.need_tokens or cfg.max_migrations > 0
        if wants_tokenizer and toks.fallback is None and cfg.model and not cfg.tokenizer_from_engines:
            from engine.tokenizer import load_tokenizer

            tok = await asyncio.to_thread(load_tokenizer, cfg.model)
            toks.fallback = await asyncio.to_thread(PromptTokenizer, tok)
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30.0, ttl_dns_cache=10),
            timeout=aiohttp.ClientTimeout(total=None, connect=cfg.connect_timeout_s, sock_read=cfg.request_timeout_s),
            auto_decompress=False, skip_auto_headers=("User-Agent", "Accept-Encoding"))
        self.proxy = Proxy(self.metrics, self.session, cfg.max_attempts, cfg.internal_token,
                           own_credentials=self.ratelimit is not None)
        await self.fleet.start()
        if self.ratelimit is not None:
            await self.ratelimit.start()
        if wants_tokenizer:
            self.pools.catalog_listeners.append(self._models_changed)
        await self.pools.start()
        # What start-up built (the tokenizer, its chat template, the libraries) lives as long as the process: out of
        # the collector's reach, a full collection no longer walks it (measured under 64 streamed connections: 22
        # full collections of ~100 ms each in 10 s, a fifth of the router's CPU; with the freeze 0.27 s in all)
        gc.freeze()


    def _models_changed(self) -> None:
        """The models served changed: load their pools' `tokenizer:` paths, fetch the others' from their engines."""
        self.tokenizers.load_paths(self.pools.tokenizer_paths())
        if not self.cfg.tokenizer_from_engines:
            return
        for model, pools in self.pools.catalog.pools_of.items():
            if all(self.fleet.engine_of(p).kind in THIRD_PARTY for p in pools):
                continue  # none of its engines serves a tokenizer
            self.tokenizers.fetch(model, self.session, lambda m=model: self._kvfleet_urls(m), self._internal_headers)

    def _kvfleet_urls(self, model: str) -> list[str]:
        """The ready replicas serving `model` that may serve kvfleet's tokenizer endpoint (not declared, nor seen
        by their metric names, to be vLLM or SGLang)."""
        out = []
        on_demand = {pc.spec.name for pc in self.pools.config.pools if model in dict(pc.spec.adapters)}
        for pool in self.pools.catalog.pools_of.get(model, ()):
            if self.fleet.engine_of(pool).kind not in THIRD_PARTY:
                # a LoRA adapter is tokenized as its base model: any of the pool's replicas serves that tokenizer
                adapter = pool in on_demand or self.fleet.placement.is_adapter(model)
                unfit = frozenset() if adapter else self.fleet.not_serving(pool, model)
                out.extend(u for u in self.fleet.ready_urls(pool)
                           if u not in unfit and self.fleet.replicas[u].engine not in THIRD_PARTY)
        return out

    def _base_tokenizer(self, model: str):
        """For a LoRA adapter (a pool's on-demand `adapters:` or listed with a parent), the tokenizer of a model its
        pools declare, if one is ready: an adapter tokenizes as its base model."""
        pools = self.pools.catalog.pools_of.get(model, ())
        for pc in self.pools.config.pools:
            if pc.spec.name in pools and (model in dict(pc.spec.adapters) or self.fleet.placement.is_adapter(model)):
                for base in pc.spec.models:
                    if base != model and (tok := self.tokenizers.get(base)) is not None:
                        return tok
        return None

    @property
    def waiting_for_tokenizer(self) -> bool:
        """No model's tokenizer is there yet, and one is on its way from a ready engine (a single-model fleet's
        start-up): the same condition under which that model's requests wait."""
        toks = self.tokenizers
        return self.need_tokens and not toks.any_ready() and any(
            toks.pending(m) and self._kvfleet_urls(m) for m in self.pools.catalog.pools_of)

    def not_serving(self) -> str | None:
        """Why a chat through this router cannot succeed now (None: it can): /ready and /v1/models say so."""
        if self.draining:
            return "draining"
        if self.waiting_for_tokenizer:
            return "waiting for the tokenizer from a ready engine"
        return None if self.fleet.ready_urls() else "no ready replica"

    async def drain(self, timeout: float) -> None:
        """SIGTERM: /ready turns 503 (load balancers stop sending here), new completion requests get 503 +
        Retry-After, running ones (streams too) finish for up to `timeout` s."""
        self.draining = True
        log.info("draining: %d requests in flight, up to %.1f s", self.inflight, timeout)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            log.info("drained")
        except asyncio.TimeoutError:
            log.warning("drain timeout: %d requests still running are cut", self.inflight)

    async def shutdown(self) -> None:
        self.tokenizers.stop()
        if self.gate is not None:
            await self.gate.stop()
        await self.pools.stop()
        await self.fleet.stop()
        if self.ratelimit is not None:
            await self.ratelimit.stop()
        if self.session is not None:
            await self.session.close()

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
            else:
                await self._models(send, scope["headers"])
            return
        await send_json(send, 404, error_body(f"no route for {method} {path}", error_type(404)))

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
            await fleet_models(self.session, self.fleet.ready_urls(), self._internal_headers), served,
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
        try:  # parsed once: the typed request of contract/request.py
            req = parse_request(Endpoint(path), raw)
        except RequestError as e:
            await send_json(send, e.status, error_body(str(e), error_type(e.status), e.param, e.code))
            return
        headers = scope["headers"]
        tenant = self.admission.identify(headers)
        if isinstance(tenant, Refusal):
            await send_json(send, tenant.status, tenant.body, tenant.headers)
            return
        t0 = time.perf_counter()
        req = self.admission.model(req, tenant)  # the model decides the pools and the tokenizer
        if isinstance(req, Refusal):
            await send_json(send, req.status, req.body, req.headers)
            return
        tokenizer = self.tokenizers.get(req.model) or self._base_tokenizer(req.model)  # a LoRA adapter: its base's
        if self.need_tokens and tokenizer is None and self.tokenizers.pending(req.model) \
                and self._kvfleet_urls(req.model):
            await send_json(send, 503, error_body(f"the router is still fetching the tokenizer of {req.model} "
                                                  "from its engines; retry", error_type(503), None, "no_ready_replica"),
                            [(b"retry-after", b"1")])
            return
        hdr = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers if k in (b"x-session-id",)}
        prep = prepare_request(path, req.body, hdr, tokenizer, self.need_tokens)
        kind = constrained_kind(req.body)
        if kind is not None:
            self.metrics.constrained.labels(kind).inc()
        counts = prompt_token_counts(path, req.body, tokenizer, prep)
        admitted = await self.admission.admit(req, tenant, prep.session_key, counts)
        if isinstance(admitted, Refusal):
            await send_json(send, admitted.status, admitted.body, admitted.headers)
            return
        req, pool = admitted.request, admitted.pool
        prep.cache_salt = req.cache_salt
        await self.adapters.prepare(prep, req.model, pool.name, dict(pool.adapters))  # hashes per adapter; on demand
        passed: Pass | None = None
        try:
            if self.gate is not None:  # a full pool: wait in its fair queue (router/admission/gate.py)
                got = await self._queued(receive, self.gate.enter(
                    pool.name, tenant.name if tenant is not None else "-", tenant.weight if tenant is not None else 1.0,
                    _priority(req), sum(counts), tenant.priority if tenant is not None else 0))
                if got is None:  # the client went away while queued: nothing reached an engine
                    return
                if isinstance(got, Refusal):
                    await send_json(send, got.status, got.body, got.headers + admitted.headers)
                    return
                passed = got
            await self._send_upstream(send, receive, path, headers, req, tenant, pool, prep, attempts, admitted,
                                      passed, t0)
        finally:
            if passed is not None:
                usage = attempts.usage if isinstance(attempts.usage, dict) else {}
                output = usage.get("completion_tokens")
                passed.done(output if isinstance(output, int) else 0)
            if admitted.budget is not None:  # however it ended: charge what was used, refund the rest
                reported = attempts.follower.used if attempts.follower is not None else None
                await asyncio.shield(self.ratelimit.settle(admitted.budget, reported, attempts.answered))
            self._observe(pool.name, req.model, prep, attempts, t0)

    async def _send_upstream(self, send, receive, path, headers, req, tenant, pool, prep, attempts, admitted,
                             passed: Pass | None, t0: float) -> None:
        if self.cfg.forward_priority and req.get("priority") is None:
            # tenants: higher first; engines: lower first; the express lane one ahead of that (router/admission/gate.py)
            priority = (-tenant.priority if tenant is not None else 0) - (1 if passed is not None and passed.express else 0)
            if priority:
                req = req.with_fields(priority=priority)
        if req.stream and (tenant is not None or self.cfg.pools_file is not None
                           or (passed is not None and passed.metered)):
            # usage in the stream: every chunk for a tenant (a cancelled stream is charged what it used), the
            # last one for a pool's hit rate and TPOT and a congested pool's fair queue; what the client did not
            # ask for is taken out again
            wanted, options = ask_for_usage(req.get("stream_options"), continuous=tenant is not None)
            req = req.with_fields(stream_options=options)
            attempts.follower = StreamUsage(wanted)
        elif tenant is not None:
            attempts.follower = StreamUsage()
        if self.cfg.max_migrations and req.stream and why_not(req) is None \
                and self.fleet.engine_of(pool.name).kind != "sglang":  # SGLang sends no token ids
            # a stream that may move to another replica if its own fails (router/http/migrate.py): the engine
            # sends the token ids a continuation starts from; the client gets them only if it asked
            keep = req.get(RETURN_TOKEN_IDS) is True
            if not keep:
                req = req.with_fields(**{RETURN_TOKEN_IDS: True})
            attempts.resume = Resume(req, pool.name, keep, self.tokenizers.get(req.model), self.cfg.max_migrations)
        body = req.upstream_body()  # written once, here
        prepared_s = time.perf_counter() - t0
        metrics = self.metrics
        unfit = self.fleet.not_serving(pool.name, req.model)  # replicas of the pool that list other models
        source = None  # with disaggregation: the replica that prefilled the prompt
        if pool.role == "decode" and (prefill_pool := self.pools.prefill_pool(req.model)) is not None:
            source = await prefill(self.proxy.session, self.fleet, metrics, path, req, prep, prefill_pool,
                                   forward_headers(headers, self.cfg.internal_token, self.proxy.own_credentials))

        def lease(p, tried):
            if passed is not None:
                passed.sent()
            t = time.perf_counter()
            ls = pull_from(self.fleet.lease(p, tried | unfit if unfit else tried, pool.name), source,
                           p.num_prompt_tokens)
            metrics.decision_seconds.observe(time.perf_counter() - t + (prepared_s if not tried else 0.0))
            if ls is not None:
                metrics.decisions.labels(metrics.policy, ls.reason).inc()
            return ls

        await self._forward(send, receive, path, body, headers, prep, lease, attempts, admitted.headers)

    def _observe(self, pool: str, model: str, prep: PreparedRequest, attempts: Attempts, t0: float) -> None:
        """The request's outcome and latencies into its pool's metrics and degradation signals."""
        status = attempts.status
        if status is None:  # the client went away: says nothing about the pool
            return
        m, version = self.metrics, self.pools.version(pool)
        if attempts.no_replica:  # no replica ready (start-up, a rollout): capacity's signal, not the pool's
            m.pool_no_replica.labels(pool, version, model).inc()
            return
        m.pool_requests.labels(pool, version, model, status).inc()
        usage = attempts.usage if isinstance(attempts.usage, dict) else {}
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(prompt, int):
            m.pool_prompt_tokens.labels(pool, version, model).inc(prompt)
            if isinstance(cached, int):
                m.pool_cached_tokens.labels(pool, version, model).inc(cached)
        ttft = tpot = None
        if prep.stream and attempts.first_token_at is not None:
            ttft = attempts.first_token_at - t0
            m.pool_ttft.labels(pool, version, model).observe(ttft)
            if attempts.ended_at is not None and isinstance(completion, int) and completion > 1:
                tpot = (attempts.ended_at - attempts.first_token_at) / (completion - 1)
                m.pool_tpot.labels(pool, version, model).observe(tpot)
        failed = status in ("error", "429") or status.startswith("5")
        self.pools.record(pool, failed, ttft, tpot)

    @staticmethod
    async def _queued(receive, entering):
        """The gate's answer, or None when the client disconnects first (the wait is cancelled)."""
        work = asyncio.ensure_future(entering)
        disconnect = asyncio.ensure_future(_wait_disconnect(receive))
        await asyncio.wait((work, disconnect), return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            return None
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


def _priority(req) -> int:
    """The request's own `priority` (vLLM's field: lower first), for its place among its tenant's queued ones."""
    p = req.get("priority")
    return p if isinstance(p, int) and not isinstance(p, bool) else 0


async def _wait_disconnect(receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return

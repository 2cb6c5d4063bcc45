"""What every edge of the router stands on: the fleet (placement core and its background checks), the pools,
the tenants' rate limiter, the admission pipeline, the fair-queue gate, each model's tokenizer and the LoRA
adapter loader - built once from a RouterConfig, started and stopped together.

The HTTP router (router/http/app.py) and the endpoint picker (router/epp/) are two edges over one RouterCore:
neither builds or wires any of these itself. One request's way through them is router/requests/flow.py.
"""

from __future__ import annotations

import asyncio
import gc
from functools import partial

import aiohttp

from router.admission.fair_queue import FairQueueConfig
from router.admission.gate import Gate
from router.admission.pipeline import Admission
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.pools.control import Pools
from router.requests.tokenizers import THIRD_PARTY, Tokenizers
from router.routing.adapters import AdapterLoader
from router.routing.fleet import Fleet
from router.routing.tokens import PromptTokenizer
from router.tenants.ratelimit import RateLimiter


class RouterCore:
    def __init__(self, cfg: RouterConfig, tokenizer=None):
        self.cfg = cfg
        self.metrics = RouterMetrics(cfg.policy)
        self.fleet = Fleet(cfg, self.metrics)
        self.metrics.attach(self.fleet)
        self.tokenizers = Tokenizers(tokenizer)
        # engine pools and tenants (a bad pools or tenants file raises here, before anything serves)
        self.pools = Pools(cfg, self.fleet, self.metrics)
        self.ratelimit = (RateLimiter(cfg.ratelimit, self.metrics, self.fleet.load, cfg.request_timeout_s,
                                      internal_token=cfg.internal_token) if cfg.ratelimit.tenants_file else None)
        self.admission = Admission(self.pools, self.ratelimit, self.metrics, cfg.ratelimit.shedding, cfg.default_model)
        self.gate = (Gate(FairQueueConfig(max_per_tenant=cfg.queue_max_per_tenant, max_total=cfg.queue_max_total,
                                          timeout_s=cfg.queue_timeout_s),
                          lambda pool: self.fleet.room(pool, cfg.replica_slots), self.metrics,
                          seats=(lambda pool: self.fleet.seats(pool, cfg.replica_slots)) if cfg.forward_priority
                          else None)
                     if cfg.replica_slots > 0 else None)
        self.need_tokens = (self.fleet.policy.needs.prompt_tokens or self.ratelimit is not None
                            or cfg.pools_file is not None or self.gate is not None)
        self.session: aiohttp.ClientSession | None = None
        self.internal_headers = {"authorization": f"Bearer {cfg.internal_token}"} if cfg.internal_token else {}
        self.adapters = AdapterLoader(self.fleet, lambda: self.session, self.internal_headers, self.metrics)  # LoRA

    # -- lifecycle -----------------------------------------------------------------------------------------
    async def start(self, wants_tokenizer: bool | None = None) -> None:
        """Load the tokenizer (to count and hash prompts; `wants_tokenizer` True: for an edge's own needs too),
        open the HTTP session, start the fleet's checks, the rate limiter and the pools' discovery."""
        cfg = self.cfg
        toks = self.tokenizers
        wants = self.need_tokens or bool(wants_tokenizer)
        if wants and toks.fallback is None and cfg.model and not cfg.tokenizer_from_engines:
            from engine.tokenizer import load_tokenizer

            tok = await asyncio.to_thread(load_tokenizer, cfg.model)
            toks.fallback = await asyncio.to_thread(PromptTokenizer, tok)
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30.0, ttl_dns_cache=10),
            timeout=aiohttp.ClientTimeout(total=None, connect=cfg.connect_timeout_s, sock_read=cfg.request_timeout_s),
            auto_decompress=False, skip_auto_headers=("User-Agent", "Accept-Encoding"))
        await self.fleet.start()
        if self.ratelimit is not None:
            await self.ratelimit.start()
        if wants:
            self.pools.catalog_listeners.append(self._models_changed)
        await self.pools.start()
        # What start-up built (the tokenizer, its chat template, the libraries) lives as long as the process: out of
        # the collector's reach, a full collection no longer walks it (measured under 64 streamed connections: 22
        # full collections of ~100 ms each in 10 s, a fifth of the router's CPU; with the freeze 0.27 s in all)
        gc.freeze()

    async def stop(self) -> None:
        self.tokenizers.stop()
        if self.gate is not None:
            await self.gate.stop()
        await self.pools.stop()
        await self.fleet.stop()
        if self.ratelimit is not None:
            await self.ratelimit.stop()
        if self.session is not None:
            await self.session.close()

    # -- tokenizers ----------------------------------------------------------------------------------------
    def _models_changed(self) -> None:
        """The models served changed: load their pools' `tokenizer:` paths, fetch the others' from their engines."""
        self.tokenizers.load_paths(self.pools.tokenizer_paths())
        if not self.cfg.tokenizer_from_engines or self.session is None:
            return
        session = self.session
        for model, pools in self.pools.catalog.pools_of.items():
            if all(self.fleet.engine_of(p).kind in THIRD_PARTY for p in pools):
                continue  # none of its engines serves a tokenizer
            self.tokenizers.fetch(model, session, partial(self.kvfleet_urls, model), self.internal_headers)

    def kvfleet_urls(self, model: str) -> list[str]:
        """The ready replicas serving `model` that may serve kvfleet's tokenizer endpoint (not declared, nor seen
        by their metric names, to be vLLM or SGLang)."""
        out: list[str] = []
        on_demand = {pc.spec.name for pc in self.pools.config.pools if model in dict(pc.spec.adapters)}
        for pool in self.pools.catalog.pools_of.get(model, ()):
            if self.fleet.engine_of(pool).kind not in THIRD_PARTY:
                # a LoRA adapter is tokenized as its base model: any of the pool's replicas serves that tokenizer
                adapter = pool in on_demand or self.fleet.placement.is_adapter(model)
                unfit = frozenset() if adapter else self.fleet.not_serving(pool, model)
                out.extend(u for u in self.fleet.ready_urls(pool)
                           if u not in unfit and self.fleet.replicas[u].engine not in THIRD_PARTY)
        return out

    def tokenizer(self, model: str) -> PromptTokenizer | None:
        """The model's tokenizer; for a LoRA adapter (a pool's on-demand `adapters:` or listed with a parent) that
        of a model its pools declare, if one is ready: an adapter tokenizes as its base model."""
        tok = self.tokenizers.get(model)
        if tok is not None:
            return tok
        pools = self.pools.catalog.pools_of.get(model, ())
        for pc in self.pools.config.pools:
            if pc.spec.name in pools and (model in dict(pc.spec.adapters) or self.fleet.placement.is_adapter(model)):
                for base in pc.spec.models:
                    if base != model and (tok := self.tokenizers.get(base)) is not None:
                        return tok
        return None

    def tokenizer_pending(self, model: str) -> bool:
        """The model's requests must wait: its tokenizer is on its way from a ready engine."""
        return self.need_tokens and self.tokenizers.pending(model) and bool(self.kvfleet_urls(model))

    @property
    def waiting_for_tokenizer(self) -> bool:
        """No model's tokenizer is there yet, and one is on its way from a ready engine (a single-model fleet's
        start-up): the same condition under which that model's requests wait."""
        toks = self.tokenizers
        return self.need_tokens and not toks.any_ready() and any(
            toks.pending(m) and self.kvfleet_urls(m) for m in self.pools.catalog.pools_of)

    def not_serving(self, draining: bool = False) -> str | None:
        """Why a request through this router cannot succeed now (None: it can): readiness says so."""
        if draining:
            return "draining"
        if self.waiting_for_tokenizer:
            return "waiting for the tokenizer from a ready engine"
        return None if self.fleet.ready_urls() else "no ready replica"

"""One request's way through the router, the same for every edge (router/http/app.py, router/epp/):

    entry = await flow.admit(path, raw_body, headers)   # parse once -> tenant -> model -> tokens -> admission
    refused = await flow.queue(entry)                   # a full pool: its fair queue (None: let through)
    req = flow.upstream(entry)                          # the request as it goes upstream (priority, usage)
    headers = flow.upstream_headers(entry, headers)     # ... and its headers (the tenant as the fairness id)
    lease = flow.lease(entry, tried)                    # the placement core's replica, booked
    ...the edge sends it (the proxy) or names it (the picker)...
    await flow.finish(entry, outcome)                   # gate, budget settled on the usage, pool signals

Each step returns a Refusal (router/refusal.py) where it answers the request itself; the edge writes it in its
own wire format (an HTTP response, an ext_proc ImmediateResponse).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

from contract.fairness import FAIRNESS_HEADER
from contract.request import Endpoint, OpenAIRequest, RequestError, parse_request
from contract.slo import HEADERS as slo_headers
from contract.slo import TPOT_HEADER, TTFT_HEADER, latency_targets
from contract.structured import constrained_kind
from router.admission.gate import Pass
from router.admission.pipeline import Admitted
from router.pools.choice import PoolSpec
from router.refusal import Refusal, refuse
from router.requests.core import RouterCore
from router.requests.usage import StreamUsage, ask_for_usage
from router.routing.lease import Lease
from router.routing.prepare import PreparedRequest, prepare_request, prompt_token_counts
from router.tenants.ledger import RecordMeta
from router.tenants.registry import Tenant, api_key_id

SESSION_HEADERS = (b"x-session-id",)
SLO_HEADERS = tuple(h.encode() for h in slo_headers)
_TTFT, _TPOT = TTFT_HEADER.encode(), TPOT_HEADER.encode()
_FAIRNESS = FAIRNESS_HEADER.encode()
_REQUEST_ID = b"x-request-id"


def new_request_id() -> str:
    return "req_" + uuid.uuid4().hex[:24]


@dataclass(slots=True)
class Entry:
    """A request admitted: what goes upstream, and what its end settles."""

    path: str
    req: OpenAIRequest
    tenant: Tenant | None
    admitted: Admitted
    prep: PreparedRequest
    counts: list[int]
    t0: float  # perf_counter when admission began (TTFT counts from here)
    passed: Pass | None = None  # let through the pool's gate
    follower: StreamUsage | None = None  # reads the usage the response reports (budgets, pool signals)
    prepared_s: float = 0.0  # seconds from t0 until the request was ready to place
    unfit: frozenset[str] = field(default_factory=frozenset)  # replicas of the pool listing other models
    request_id: str = field(default_factory=new_request_id)  # the ledger's, and x-request-id
    api_key_id: str | None = None  # the first 16 hex digits of the client key's sha256 (never the key)

    @property
    def pool(self) -> PoolSpec:
        return self.admitted.pool

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        """For the response: the pool, max_tokens lowered, x-ratelimit-*, and the request's id in the ledger."""
        return [*self.admitted.headers, (b"x-request-id", self.request_id.encode())]


@dataclass(frozen=True, slots=True)
class Outcome:
    """How the request ended, as the edge saw it."""

    status: str | None  # the HTTP status sent (or "error"); None: the client went away
    usage: dict | None = None  # the usage the replica reported (the last one of a stream)
    answered: bool = False  # a replica's 200 response reached the client
    first_token_at: float | None = None  # perf_counter of a stream's first token
    ended_at: float | None = None  # perf_counter of its last byte
    no_replica: bool = False  # no replica could be leased at all: capacity's signal, not the pool's
    replica: str | None = None  # the replica of the last attempt


def _slo(core: RouterCore, prep: PreparedRequest, pool: PoolSpec) -> Refusal | None:
    """The request's TTFT and TPOT targets (its headers', else its tenant's, else its pool's) checked against the
    pool's predictions: the 429 when no replica is predicted to meet them."""
    if prep.ttft_target_s is None:
        prep.ttft_target_s = pool.slo_ttft_s
    if prep.tpot_target_s is None:
        prep.tpot_target_s = pool.slo_tpot_s
    refused = core.fleet.slo_refusal(prep, pool.name, pool.slo_unattainable == "best_effort")
    if refused is not None:  # wanted and not served: demand the pool's size must meet (router/pools/sizing.py)
        core.pools.served(pool.name, prep.num_prompt_tokens, 0, None, 0.0, prep.ttft_target_s, prep.tpot_target_s,
                          False)
    return refused


class Flow:
    def __init__(self, core: RouterCore):
        self.core = core

    async def admit(self, path: str, raw: bytes, headers: Sequence[tuple[bytes, bytes]],
                    model: str | None = None) -> Entry | Refusal:
        """`model`: the model the request is for instead of the one its body names (a gateway's rewrite)."""
        core = self.core
        try:  # parsed once: the typed request of contract/request.py
            req = parse_request(Endpoint(path), raw)
        except RequestError as e:
            return refuse(e.status, str(e), "invalid", e.param, e.code)
        if model is not None and model != req.model:
            req = req.with_fields(model=model)
        tenant = core.admission.identify(headers)
        if isinstance(tenant, Refusal):
            return tenant
        t0 = time.perf_counter()
        got = core.admission.model(req, tenant)  # the model decides the pools and the tokenizer
        if isinstance(got, Refusal):
            return got
        req = got
        model = req.model or ""
        tokenizer = core.tokenizer(model)
        if tokenizer is None and core.tokenizer_pending(model):
            return refuse(503, f"the router is still fetching the tokenizer of {model} from its engines; retry",
                          "no_ready_replica", None, "no_ready_replica", [(b"retry-after", b"1")])
        hdr = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers
               if k.lower() in SESSION_HEADERS or k.lower() in SLO_HEADERS}
        try:
            targets = latency_targets(hdr)
        except RequestError as e:
            return refuse(e.status, str(e), "invalid", e.param, e.code)
        prep = prepare_request(path, req.body, hdr, tokenizer, core.need_tokens)
        prep.ttft_target_s = targets.ttft_s if targets.ttft_s is not None else (
            tenant.slo_ttft_s if tenant is not None else None)
        prep.tpot_target_s = targets.tpot_s if targets.tpot_s is not None else (
            tenant.slo_tpot_s if tenant is not None else None)
        kind = constrained_kind(req.body)
        if kind is not None:
            core.metrics.constrained.labels(kind).inc()
        counts = prompt_token_counts(path, req.body, tokenizer, prep)
        request_id, key_id = new_request_id(), api_key_id(headers) if tenant is not None else None
        admitted = await core.admission.admit(req, tenant, prep.session_key, counts, request_id, key_id,
                                              partial(_slo, core, prep))
        if isinstance(admitted, Refusal):
            return admitted
        prep.cache_salt = admitted.request.cache_salt
        pool = admitted.pool
        # hashes per adapter; an adapter loaded on demand where the score puts it
        await core.adapters.prepare(prep, model, pool.name, dict(pool.adapters))
        return Entry(path, admitted.request, tenant, admitted, prep, counts, t0, request_id=request_id,
                     api_key_id=key_id)

    async def queue(self, entry: Entry, fairness_id: str | None = None, priority: int | None = None
                    ) -> Refusal | None:
        """A full pool's fair queue (router/admission/gate.py): None once let through (straight on, or released
        in the queue's order); its 429 / 503 otherwise. Cancelled with the request (it leaves the queue).
        Without a tenant, `fairness_id` (a gateway's) is whom the queue is fair across; `priority` (lower first)
        orders a tenant's own queued requests instead of the request's `priority` field."""
        gate = self.core.gate
        if gate is None:
            return None
        t = entry.tenant
        name = t.name if t is not None else (fairness_id or "-")
        if priority is None:
            priority = _priority(entry.req) + (1 if entry.prep.best_effort else 0)
        got = await gate.enter(entry.pool.name, name, t.weight if t is not None else 1.0, priority, sum(entry.counts),
                               t.priority if t is not None else 0)
        if isinstance(got, Refusal):
            return got._replace(headers=got.headers + entry.headers)
        entry.passed = got
        return None

    def upstream(self, entry: Entry) -> OpenAIRequest:
        """The request as it goes upstream: the tenant's priority for the engines (--forward-priority), and usage
        in the stream where its end needs it (budgets, a pool's signals, a congested pool's fair queue)."""
        cfg, req, tenant, passed = self.core.cfg, entry.req, entry.tenant, entry.passed
        if cfg.forward_priority and req.get("priority") is None:
            # tenants: higher first; engines: lower first; the express lane one ahead of that (router/admission/gate.py)
            priority = (-tenant.priority if tenant is not None else 0) - (1 if passed is not None and passed.express else 0)
            if priority:
                req = req.with_fields(priority=priority)
        if cfg.forward_priority and entry.prep.best_effort:  # a target no replica was predicted to meet: behind
            req = req.with_fields(priority=_priority(req) + 1)  # the others at the engine (vLLM refuses it in fcfs)
        if req.stream and (tenant is not None or cfg.pools_file is not None or (passed is not None and passed.metered)
                           or entry.prep.tpot_target_s is not None or self.core.fleet.sample_tpot()):
            # usage in the stream: every chunk for a tenant (a cancelled stream is charged what it used), the
            # last one for a pool's hit rate and TPOT, a congested pool's fair queue, a TPOT target's attainment
            # and the TPOT model (a sample of the other streams); what the client did not ask for is taken out
            # again (StreamUsage.feed)
            wanted, options = ask_for_usage(req.get("stream_options"), continuous=tenant is not None)
            req = req.with_fields(stream_options=options)
            entry.follower = StreamUsage(wanted)
        elif tenant is not None:
            entry.follower = StreamUsage()
        entry.req = req
        entry.prepared_s = time.perf_counter() - entry.t0
        entry.unfit = self.core.fleet.not_serving(entry.pool.name, req.model or "")
        return req

    @staticmethod
    def upstream_headers(entry: Entry, headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """The client's headers for the engines, with the router's x-request-id (the ledger's: the engine's usage
        lookup answers by it) instead of a client's, and the request's fairness id (contract/fairness.py): its
        tenant's name, a client's own value dropped (no tenant passes for another); without tenants, as sent."""
        drop = (_REQUEST_ID,) if entry.tenant is None else (_REQUEST_ID, _FAIRNESS)
        out = [(k, v) for k, v in headers if k.lower() not in drop]
        out.append((_REQUEST_ID, entry.request_id.encode()))
        # a target the request took from its tenant or pool goes to the engine as if the client had sent it (the
        # engine sizes its steps for it); a client's own header already went as sent
        sent = {k.lower() for k, _ in headers}
        for name, target in ((_TTFT, entry.prep.ttft_target_s), (_TPOT, entry.prep.tpot_target_s)):
            if target is not None and name not in sent:
                out.append((name, f"{target * 1000:g}".encode()))
        if entry.tenant is not None:
            out.append((_FAIRNESS, entry.tenant.name.encode("latin-1", "replace")))
        return out

    async def sending(self, entry: Entry, replica: str) -> None:
        """The request is about to go to `replica`: its pending ledger record names it first (router/tenants/
        pending.py), so a router that reconciles it after this one died knows whom to ask what it used."""
        if entry.admitted.budget is not None and self.core.ratelimit is not None:
            await self.core.ratelimit.attach(entry.admitted.budget, entry.request_id, replica)

    def lease(self, entry: Entry, tried: set[str] | frozenset[str] = frozenset(), *,
              candidates: Sequence[str] | None = None) -> Lease | None:
        """The placement core's replica of the entry's pool (not one `tried`, not one listing other models; among
        `candidates` only, when given), booked; None when none is routable. Counted in the decision metrics."""
        core, m = self.core, self.core.metrics
        if entry.passed is not None:
            entry.passed.sent()
        t = time.perf_counter()
        excluded = tried | entry.unfit if entry.unfit else tried
        ls = core.fleet.lease(entry.prep, excluded, entry.pool.name, candidates)
        m.decision_seconds.observe(time.perf_counter() - t + (entry.prepared_s if not tried else 0.0))
        if ls is not None:
            m.decisions.labels(m.policy, ls.reason).inc()
        return ls

    async def finish(self, entry: Entry, outcome: Outcome) -> None:
        """However it ended: the gate's seat freed, the budget charged what was used (the rest refunded), the
        outcome into the pool's metrics and degradation signals."""
        core = self.core
        usage = outcome.usage if isinstance(outcome.usage, dict) else {}
        if entry.passed is not None:
            output = usage.get("completion_tokens")
            entry.passed.done(output if isinstance(output, int) else 0)
        if entry.admitted.budget is not None and core.ratelimit is not None:
            reported = entry.follower.last if entry.follower is not None else None
            now = time.perf_counter()
            ttft = outcome.first_token_at - entry.t0 if outcome.first_token_at is not None else None
            meta = RecordMeta(entry.request_id, entry.api_key_id, entry.pool.name, outcome.replica,
                              outcome.status or "disconnected", now - entry.t0, ttft)
            await asyncio.shield(core.ratelimit.settle(entry.admitted.budget, reported, outcome.answered, meta))
        self._observe(entry, outcome, usage)

    def _observe(self, entry: Entry, outcome: Outcome, usage: dict) -> None:
        status = outcome.status
        if status is None:  # the client went away: says nothing about the pool
            return
        core = self.core
        pool, model = entry.pool.name, entry.req.model or "-"
        m, version = core.metrics, core.pools.version(pool)
        if outcome.no_replica:  # no replica ready (start-up, a rollout): capacity's signal, not the pool's
            m.pool_no_replica.labels(pool, version, model).inc()
            return
        m.pool_requests.labels(pool, version, model, status).inc()
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(prompt, int):
            m.pool_prompt_tokens.labels(pool, version, model).inc(prompt)
            if isinstance(cached, int):
                m.pool_cached_tokens.labels(pool, version, model).inc(cached)
        ttft = tpot = None
        if entry.prep.stream and outcome.first_token_at is not None:
            ttft = outcome.first_token_at - entry.t0
            m.pool_ttft.labels(pool, version, model).observe(ttft)
            if outcome.ended_at is not None and isinstance(completion, int) and completion > 1:
                tpot = (outcome.ended_at - outcome.first_token_at) / (completion - 1)
                m.pool_tpot.labels(pool, version, model).observe(tpot)
        tier = str(entry.tenant.priority) if entry.tenant is not None else "-"
        target = entry.prep.ttft_target_s
        if target is not None and ttft is not None:  # a streamed request with a TTFT target: met or missed
            m.slo_ttft.labels(pool, tier, "met" if ttft <= target else "missed").inc()
        target = entry.prep.tpot_target_s
        if target is not None and tpot is not None:  # ... with a TPOT target, over its tokens after the first
            m.slo_tpot.labels(pool, tier, "met" if tpot <= target else "missed").inc()
        failed = status in ("error", "429") or status.startswith("5")
        core.pools.record(pool, failed, ttft, tpot)
        if isinstance(prompt, int):
            ttft_t, tpot_t = entry.prep.ttft_target_s, entry.prep.tpot_target_s
            core.pools.served(pool, prompt, cached if isinstance(cached, int) else 0,
                              completion if isinstance(completion, int) else None,
                              time.perf_counter() - entry.t0, ttft_t, tpot_t,
                              _met(((ttft, ttft_t), (tpot, tpot_t)), failed))


def _met(seen_and_targets: tuple[tuple[float | None, float | None], ...], failed: bool) -> bool | None:
    """Whether a request met its targets: None without one or with none measured (not streamed), False if it
    failed, else each measured one within its target."""
    targets = [(seen, t) for seen, t in seen_and_targets if t is not None]
    if not targets:
        return None
    if failed:
        return False
    measured = [seen <= t for seen, t in targets if seen is not None]
    return all(measured) if measured else None


def _priority(req: OpenAIRequest) -> int:
    """The request's own `priority` (vLLM's field: lower first), for its place among its tenant's queued ones."""
    p = req.get("priority")
    return p if isinstance(p, int) and not isinstance(p, bool) else 0

"""One ext_proc stream: one HTTP request through the gateway, as the endpoint picker sees it.

  request headers (+ body chunks until end of stream) -> admission (router/requests/flow.py; the stream is held
    while the pool's fair queue holds the request) -> the placement core's replica, and its ordered fallbacks ->
    HeadersResponse naming them + the upstream body back as streamed mutations
  response headers (the served endpoint) -> the booking moves there if a fallback served; response body chunks
    pass back (usage read, and taken out where the client did not ask for it) -> at the end of the response:
    the lease's verdict, the budget settled, the pool's signals (flow.finish)

A stream that ends early (the client went away, the gateway gave up) releases whatever it held.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from contract.kv_transfer import PULL_HEADER, pull_header
from router.epp import wire
from router.refusal import Refusal, refuse
from router.requests.core import RouterCore
from router.requests.flow import Entry, Flow, Outcome
from router.requests.usage import output_tokens
from router.routing.lease import Lease
from router.routing.prepare import CHAT_PATH, COMPLETIONS_PATH

COMPLETION_PATHS = (CHAT_PATH, COMPLETIONS_PATH)
USAGE_BODY_MAX = 4 * 1024 * 1024  # a whole (non-streamed) response is read for its usage up to this size
CREDENTIAL_HEADERS = ("authorization", "api-key")  # a client's never reach an engine when tenants are on


@dataclass
class PickerSettings:
    fallbacks: int = 2  # endpoints named after the primary, in order
    objectives: dict[str, int] = field(default_factory=dict)  # InferenceObjective name -> priority (higher first)


class PickStream:
    def __init__(self, core: RouterCore, flow: Flow, settings: PickerSettings):
        self.core, self.flow, self.settings = core, flow, settings
        self.headers: list[tuple[bytes, bytes]] = []
        self.metadata: ep.ProcessingRequest | None = None
        self.body = bytearray()
        self.body_seen = False  # the request had a body (headers without end of stream): it goes back mutated
        self.entry: Entry | None = None
        self.lease: Lease | None = None
        self.status: int | None = None
        self.first_token_at: float | None = None
        self.ended_at: float | None = None
        self.whole = bytearray()  # a non-streamed response, for its usage
        self.finished = False

    async def run(self, requests: AsyncIterator[ep.ProcessingRequest]) -> AsyncIterator[ep.ProcessingResponse]:
        try:
            async for msg in requests:
                kind = msg.WhichOneof("request")
                if kind == "request_headers":
                    self.headers = wire.header_pairs(msg.request_headers)
                    self.metadata = msg
                    if msg.request_headers.end_of_stream:
                        for r in await self._pick():
                            yield r
                elif kind == "request_body":
                    self.body_seen = True
                    self.body += msg.request_body.body
                    if len(self.body) > self.core.cfg.max_body_bytes:
                        yield wire.immediate(refuse(413, f"request body is larger than {self.core.cfg.max_body_bytes}"
                                                    " bytes", "too_large", None, "request_too_large"))
                        return
                    if msg.request_body.end_of_stream:
                        for r in await self._pick():
                            yield r
                elif kind == "request_trailers":
                    yield wire.trailers(request=True)
                elif kind == "response_headers":
                    primary = self.lease
                    yield self._response_headers(msg)
                    if self.lease is not primary and self.entry is not None and self.lease is not None:
                        await self.flow.sending(self.entry, self.lease.url)  # a fallback served: ask it, if need be
                    if msg.response_headers.end_of_stream:
                        await self._finish()
                elif kind == "response_body":
                    for r in self._response_body(msg.response_body):
                        yield r
                    if msg.response_body.end_of_stream:
                        await self._finish()
                elif kind == "response_trailers":
                    yield wire.trailers(request=False)
                    await self._finish()
        finally:
            await self._finish(ended=False)

    # -- the request -----------------------------------------------------------------------------------------
    async def _pick(self) -> list[ep.ProcessingResponse]:
        path = (wire.header(self.headers, ":path") or "").split("?")[0]
        method = wire.header(self.headers, ":method") or "GET"
        hint = wire.subset_hint(self.metadata.metadata_context) if self.metadata is not None else None
        if path not in COMPLETION_PATHS or method != "POST":
            return self._pass_through(hint)
        flow = self.flow
        entry = await flow.admit(path, bytes(self.body), self.headers, wire.header(self.headers, wire.MODEL_REWRITE))
        if isinstance(entry, Refusal):
            return [wire.immediate(entry)]
        self.entry = entry
        objective = wire.header(self.headers, wire.OBJECTIVE)
        priority = self.settings.objectives.get(objective) if objective else None
        refused = await flow.queue(entry, wire.header(self.headers, wire.FAIRNESS_ID),
                                   -priority if priority is not None else None)
        if refused is not None:
            self.entry = None  # never let through: nothing to settle but its budget
            await flow.finish(entry, Outcome(str(refused.status)))
            return [wire.immediate(refused)]
        req = flow.upstream(entry)
        candidates = self._candidates(entry.pool.name, hint)
        if candidates == []:
            return [wire.immediate(self._no_endpoint(hint, entry))]
        lease = self.lease = flow.lease(entry, candidates=candidates)
        if lease is None:
            return [wire.immediate(self._no_endpoint(hint, entry))]
        chosen = [lease.url] + self._fallbacks(entry, lease.url, candidates)
        body = req.upstream_body()
        cfg = self.core.cfg
        await flow.sending(entry, lease.url)  # the pending ledger record names the replica, as the router's does
        # the ledger's x-request-id (the engine's usage lookup answers by it) and the tenant as the fairness id
        set_headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in flow.upstream_headers(entry, [])}
        set_headers["content-length"] = str(len(body))
        remove = [PULL_HEADER]  # the router's own word to an engine: a client's is dropped
        if self.core.ratelimit is not None or cfg.internal_token:
            remove += [h for h in CREDENTIAL_HEADERS if h != "authorization" or not cfg.internal_token]
        if cfg.internal_token:
            set_headers["authorization"] = f"Bearer {cfg.internal_token}"
        d = lease.decision
        if d.pull_from is not None:
            set_headers[PULL_HEADER] = pull_header(d.pull_from, d.pull_pending)
            self.core.metrics.pulls.labels(lease.url, d.pull_from).inc()
            self.core.metrics.pull_tokens.labels(lease.url).inc(d.pull_tokens)
        # a header set here replaces the client's anyway: never also removed (a gateway that applies removals after
        # sets, as Envoy's early ext_proc did, would drop it)
        remove = [h for h in remove if h not in set_headers]
        return [wire.picked([wire.endpoint_of(u) for u in chosen], set_headers, remove), *wire.body_chunks(body)]

    def _candidates(self, pool: str, hint: list[str] | None) -> list[str] | None:
        """The pool's replicas the gateway's subset hint allows, in the hint's order (None: no hint)."""
        if hint is None:
            return None
        by_endpoint = wire.urls_by_endpoint(self.core.fleet.members.get(pool, ()))
        return [by_endpoint[e] for e in hint if e in by_endpoint]

    def _fallbacks(self, entry: Entry, primary: str, candidates: list[str] | None) -> list[str]:
        """Where the gateway goes, in order, when the primary cannot be reached: the placement core's next
        choices (looked ahead: nothing booked, the turn not advanced)."""
        fleet, out = self.core.fleet, []
        tried = {primary} | entry.unfit
        for _ in range(self.settings.fallbacks):
            d = fleet.route(entry.prep, tried, entry.pool.name, candidates, peek=True)
            if d is None or d.url in tried:
                break
            out.append(d.url)
            tried.add(d.url)
        return out

    def _no_endpoint(self, hint: list[str] | None, entry: Entry | None) -> Refusal:
        if hint is not None:
            what = "the gateway's endpoint subset is empty" if not hint else \
                f"no endpoint of the gateway's subset ({', '.join(hint)}) is eligible"
        else:
            what = "no ready endpoint" + (f" in pool {entry.pool.name}" if entry is not None else "")
        return refuse(503, f"{what}; retry", "no_replica", None, "no_ready_replica", [(b"retry-after", b"1")])

    def _pass_through(self, hint: list[str] | None) -> list[ep.ProcessingResponse]:
        """Anything but a completion (GET /v1/models, ...): a ready endpoint of any pool, nothing admitted."""
        fleet = self.core.fleet
        ready = fleet.ready_urls()
        if hint is not None:
            allowed = set(hint)
            ready = [u for u in ready if wire.endpoint_of(u) in allowed]
        if not ready:
            return [wire.immediate(self._no_endpoint(hint, None))]
        url = min(ready, key=lambda u: len(fleet.replicas[u].tickets))
        return [wire.picked([wire.endpoint_of(url)]), *(wire.body_chunks(bytes(self.body)) if self.body_seen else [])]

    # -- the response ----------------------------------------------------------------------------------------
    def _response_headers(self, msg: ep.ProcessingRequest) -> ep.ProcessingResponse:
        self.status = wire.status_code(msg.response_headers)
        entry, lease = self.entry, self.lease
        if entry is None or lease is None:
            return wire.response_headers()
        served = wire.served_endpoint(msg.metadata_context)
        if served is not None and served != wire.endpoint_of(lease.url):
            lease = self._moved(entry, lease, served)
        extra = {k.decode("latin-1"): v.decode("latin-1") for k, v in entry.headers}
        extra["x-kvfleet-replica"] = lease.url
        return wire.response_headers(extra)

    def _moved(self, entry: Entry, primary: Lease, served: str) -> Lease:
        """A fallback served: the primary failed to take it (its circuit counts that); the booking moves."""
        primary.failed()
        primary.release()
        url = wire.urls_by_endpoint(self.core.fleet.members.get(entry.pool.name, ())).get(served)
        moved = self.core.fleet.lease(entry.prep, frozenset(), entry.pool.name, [url]) if url is not None else None
        self.lease = moved if moved is not None and moved.url == url else primary
        return self.lease

    def _response_body(self, body: ep.HttpBody) -> list[ep.ProcessingResponse]:
        chunk = bytes(body.body)
        entry, lease = self.entry, self.lease
        if entry is None or lease is None:
            return wire.body_chunks(chunk, body.end_of_stream, request=False)
        if entry.prep.stream:
            if self.first_token_at is None and b"data: " in chunk:
                self.first_token_at = time.perf_counter()
                lease.first_token()
            follower = entry.follower
            if follower is not None:
                chunk = follower.feed(chunk) + (follower.flush() if body.end_of_stream else b"")
        elif len(self.whole) + len(chunk) <= USAGE_BODY_MAX:
            self.whole += chunk
        if body.end_of_stream:
            self.ended_at = time.perf_counter()
        return wire.body_chunks(chunk, body.end_of_stream, request=False)

    async def _finish(self, ended: bool = True) -> None:
        """The response is over (ended: as the gateway said; else the stream closed first): the verdict on the
        replica, the booking released, the request settled. Once."""
        if self.finished:
            return
        self.finished = True
        entry, lease, status = self.entry, self.lease, self.status
        usage = None
        if entry is not None and lease is not None and status is not None:
            if entry.follower is not None and entry.follower.last is not None:
                usage = entry.follower.last
            elif self.whole:
                try:
                    got = json.loads(bytes(self.whole))
                    usage = got.get("usage") if isinstance(got, dict) else None
                except ValueError:
                    usage = None
                if entry.follower is not None:
                    entry.follower.body(bytes(self.whole))
            if status in (429, 503):
                lease.refused()
            elif status in (502, 504) or status >= 500 and not ended:
                lease.failed()
            else:
                lease.succeeded(output_tokens(usage) if entry.prep.stream else 0)
            m = self.core.metrics
            m.requests.labels(lease.url, m.policy, str(status)).inc()
            m.observe_usage(lease.url, lease.predicted_cached_tokens, usage)
        if lease is not None:
            lease.release()
        if entry is not None:
            done = ended and status is not None
            await self.flow.finish(entry, Outcome(str(status) if done else None, usage, done and status == 200,
                                                  self.first_token_at, self.ended_at, lease is None,
                                                  lease.url if lease is not None else None))


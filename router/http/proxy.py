"""Streaming passthrough to the leased replica (aiohttp), with retry-before-first-byte and clean failure.

- A request whose attempt fails before the replica sent any body byte (connection refused/reset, 502/503/504)
  or that the replica refuses with 429 (queue full) is retried on another replica, up to `max_attempts` in
  all. Non-streamed responses are buffered, so they can be retried until the replica finished them. When
  every attempt failed and at least one replica answered 429, the client gets that 429 (its OpenAI error
  body and `Retry-After`): the fleet is full, so try again later; otherwise a 503.
- Streamed responses start once the replica sent its first body chunk; from then on bytes pass straight
  through. A stream that can move (router/http/migrate.py) passes event by event instead, read on the way
  (router/migration/progress.py): when its replica fails after tokens went out, it goes on on another replica
  and the client sees one stream. Otherwise, or when it cannot go on, a replica that dies mid-stream ends the
  client's stream with an SSE error event and `[DONE]`.
- The caller cancels the task when the client disconnects; closing the upstream response closes its
  connection, and the engine aborts the request.
- The proxy sees replicas only through the fleet's leases (router/routing/lease.py): it reports each attempt's
  verdict, the lease keeps the replica's in-flight count and circuit breaker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import NamedTuple

import aiohttp

from contract.errors import error_body, error_type
from contract.kv_transfer import PULL_HEADER, pull_header
from router.http.migrate import Migrator, Resume
from router.http.responses import send_json
from router.migration.progress import Progress, replica_failed
from router.requests.usage import StreamUsage, output_tokens
from router.routing.lease import Lease
from router.routing.prepare import PreparedRequest
from router.states import StrEnum
from router.tenants.registry import strip_client_credentials

log = logging.getLogger("kvfleet.router.proxy")

RETRY_STATUSES = (502, 503, 504)
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                         b"trailers", b"transfer-encoding", b"upgrade", b"host", b"content-length"})
_PULL = PULL_HEADER.encode()  # the router's own word to an engine: a client's is dropped
_DROP_RESPONSE = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"date",
                            b"server", b"x-request-id"})  # the router's own x-request-id goes out instead (the ledger's)


def forward_headers(raw_headers, internal_token: str | None = None, own_credentials: bool = False
                    ) -> list[tuple[str, str]]:
    """The client's headers for the replica, hop-by-hop ones dropped. With `own_credentials` (tenants on,
    or an internal token set) the client's Authorization / api-key never go upstream; the router's internal
    token does, where one is set."""
    out = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw_headers
           if k.lower() not in _HOP_BY_HOP and k.lower() != _PULL]
    if own_credentials or internal_token:
        out = strip_client_credentials(out)
    if internal_token:
        out.append(("authorization", f"Bearer {internal_token}"))
    return out


def response_headers(raw_headers, replica: str, body_len: int | None,
                     extra: list[tuple[bytes, bytes]] = ()) -> list[tuple[bytes, bytes]]:
    out = [(k, v) for k, v in raw_headers if k.lower() not in _DROP_RESPONSE]
    out.extend(extra)
    out.append((b"x-kvfleet-replica", replica.encode("latin-1")))
    if body_len is not None:
        out.append((b"content-length", str(body_len).encode()))
    return out


def sse_error_event(message: str) -> bytes:
    err = error_body(message, error_type(502), None, "upstream_failed")
    return b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"


def _no_token(chunk: bytes) -> bool:
    """A chunk that carries no generated token: SSE comments only (`: keep-alive`), or a chat stream's opening
    chunk alone (the role, which some engines send before any token is generated)."""
    n = chunk.count(b"data: ")
    return n == 0 or (n == 1 and b'"role":"assistant"' in chunk and b'"content":""' in chunk)


def _usage_from_sse(chunk: bytes) -> dict | None:
    """The `usage` object of a streamed chunk that carries one (the engine's last chunk), else None."""
    for line in chunk.split(b"\n"):
        if line.startswith(b"data: {") and b'"usage"' in line:
            try:
                usage = json.loads(line[6:]).get("usage")
            except ValueError:
                continue
            if isinstance(usage, dict):
                return usage
    return None


class End(StrEnum):
    """How one attempt ended (values label the retries metric)."""

    DONE = "done"  # the response went to the client
    MID_STREAM = "mid-stream"  # the replica failed after the first byte
    CONNECT = "connect"  # no connection
    STATUS = "status"  # 502 / 504
    READ = "read"  # the replica failed before the first byte
    UNAVAILABLE = "unavailable"  # 503: draining or loading
    QUEUE_FULL = "queue-full"  # 429: the replica's queue is full


_REFUSALS = (End.UNAVAILABLE, End.QUEUE_FULL)


class _Result(NamedTuple):
    end: End
    detail: str  # the status label when DONE, else what went wrong
    refusal: tuple[list, bytes] | None = None  # a 429's raw headers and body, to hand on if all replicas refuse
    progress: Progress | None = None  # a stream that broke and may move: what its client got


@dataclass(slots=True)
class Attempts:
    """What the proxy did for one request, for the access log and the pool's signals (filled in as it goes)."""

    replica: str | None = None  # the replica of the last attempt
    predicted_cached_tokens: int = 0
    retries: int = 0
    answered: bool = False  # a replica's successful (200) response went to the client
    status: str | None = None  # the final status: the HTTP code sent, or "error"; None: not finished
    first_token_at: float | None = None  # perf_counter when a stream's first token went out
    ended_at: float | None = None  # perf_counter when a stream's last byte went out
    usage: dict | None = None  # the usage the replica reported (the last one of a stream)
    no_replica: bool = False  # no replica could be leased at all (none ready): not the pool's failure
    follower: StreamUsage | None = None  # set by the app: reads what was used, gives the client the usage it asked for
    resume: Resume | None = None  # set by the app for a stream that may move to another replica
    sending: Callable[[str], Awaitable[None]] | None = None  # set by the app: called with each replica before it is sent


class Proxy:
    """The data path. It uses aiohttp rather than httpx: on this path aiohttp's C parser costs ~0.4 ms per
    streamed request against ~1.2 ms for httpx (measured against loadtest/fake_engine.py), which decides
    whether one router process can pass 1,000 streamed requests/s."""

    def __init__(self, metrics, session: aiohttp.ClientSession, max_attempts: int, internal_token: str | None = None,
                 own_credentials: bool = False):
        self.metrics = metrics
        self.session = session
        self.max_attempts = max_attempts
        self.internal_token = internal_token
        self.own_credentials = own_credentials
        self.migrator = Migrator(metrics, session, max_attempts)

    async def forward(self, send, path: str, body: bytes, headers, prep: PreparedRequest,
                      lease: Callable[[PreparedRequest, set[str]], Lease | None], attempts: Attempts,
                      extra_headers: list[tuple[bytes, bytes]] = ()) -> None:
        """Proxy one completion request, on replicas leased by `lease(prep, replicas already tried)`;
        `extra_headers` go on the response (the tenant's rate-limit headers)."""
        metrics = self.metrics
        tried: set[str] = set()
        last_error = "no ready replica"
        refusal: tuple[str, list, bytes] | None = None
        fwd_headers = forward_headers(headers, self.internal_token, self.own_credentials)
        for attempt in range(self.max_attempts):
            ls = lease(prep, tried)
            if ls is None:
                break
            url = ls.url
            tried.add(url)
            attempts.replica, attempts.predicted_cached_tokens, attempts.retries = \
                url, ls.predicted_cached_tokens, attempt
            try:
                if attempts.sending is not None:
                    await attempts.sending(url)
                result = await self._attempt(send, url, path, body, fwd_headers, prep, ls, extra_headers, attempts)
                if result.end is End.DONE:
                    ls.succeeded(output_tokens(attempts.usage) if prep.stream else 0)
                elif result.end in _REFUSALS:
                    ls.refused()
                else:
                    ls.failed()
            finally:
                ls.release()  # without a verdict (client gone, or it could not be written to): abandoned
            if result.end is End.DONE:
                metrics.requests.labels(url, metrics.policy, result.detail).inc()
                attempts.status = result.detail
                return
            if result.end is End.MID_STREAM:
                if result.progress is not None:
                    await self._moved(send, url, result, fwd_headers, lease, attempts)
                    return
                metrics.requests.labels(url, metrics.policy, "error").inc()
                attempts.status = "error"
                return
            # failed or refused before the first byte: retry elsewhere
            if result.refusal is not None:
                refusal = (url, *result.refusal)
            last_error = f"{url}: {result.detail}"
            metrics.requests.labels(url, metrics.policy, "retried").inc()
            if attempt + 1 < self.max_attempts:
                metrics.retries.labels(result.end).inc()
        if refusal is not None:  # the fleet is full: hand on a replica's 429, Retry-After included
            url, raw_headers, data = refusal
            out = response_headers(raw_headers, url, len(data), extra_headers)
            if not any(k.lower() == b"retry-after" for k, _ in out):
                out.append((b"retry-after", b"1"))
            metrics.requests.labels("none", metrics.policy, "429").inc()
            attempts.status = "429"
            await send({"type": "http.response.start", "status": 429, "headers": out})
            await send({"type": "http.response.body", "body": data})
            return
        metrics.requests.labels("none", metrics.policy, "error").inc()
        attempts.status = "error"
        attempts.no_replica = not tried
        await send_json(send, 503, error_body(f"no replica could serve the request ({last_error})",
                                              error_type(503), None, "no_replica_available"),
                        list(extra_headers) + ([(b"retry-after", b"1")] if not tried else []))

    async def _moved(self, send, url: str, result: _Result, fwd_headers, lease, attempts: Attempts) -> None:
        """A stream whose replica failed after tokens went out: on to other replicas, or the error event."""
        metrics, progress, resume = self.metrics, result.progress, attempts.resume
        assert progress is not None and resume is not None  # a stream that may move broke: both were set
        if await self.migrator.resume(send, resume, progress, url, fwd_headers, lease, attempts.follower, attempts):
            metrics.requests.labels(attempts.replica, metrics.policy, "200").inc()
            attempts.status = "200"
            return
        metrics.requests.labels(url, metrics.policy, "error").inc()
        attempts.status = "error"
        if progress.error is not None:
            end = b"data: " + json.dumps(progress.error).encode() + b"\n\ndata: [DONE]\n\n"
        else:
            end = sse_error_event(f"replica {url} failed mid-stream ({result.detail}); the response is incomplete")
        await send({"type": "http.response.body", "body": end, "more_body": False})

    async def _attempt(self, send, url: str, path: str, body: bytes, fwd_headers, prep: PreparedRequest,
                       ls: Lease, extra_headers, attempts: Attempts) -> _Result:
        metrics = self.metrics
        predicted = ls.predicted_cached_tokens
        if ls.decision.pull_from is not None:  # the engine pulls the prefix a peer holds before it queues the request
            fwd_headers = [*fwd_headers, (PULL_HEADER, pull_header(ls.decision.pull_from, ls.decision.pull_pending))]
            metrics.pulls.labels(url, ls.decision.pull_from).inc()
            metrics.pull_tokens.labels(url).inc(ls.decision.pull_tokens)
        try:
            resp = await self.session.post(url + path, data=body, headers=fwd_headers)
        except _UPSTREAM_ERRORS as e:
            metrics.upstream_failures.labels(url, "connect").inc()
            return _Result(End.CONNECT, _describe(e))
        ok = False
        try:
            status = resp.status
            if status in RETRY_STATUSES or status == 429:
                data = await resp.read()
                ok = True
                if status == 429:
                    return _Result(End.QUEUE_FULL, "HTTP 429", (list(resp.raw_headers), data))
                return _Result(End.UNAVAILABLE if status == 503 else End.STATUS, f"HTTP {status}")
            if not (prep.stream and status == 200):
                try:
                    data = await resp.read()
                except _UPSTREAM_ERRORS as e:
                    metrics.upstream_failures.labels(url, "before-first-byte").inc()
                    return _Result(End.READ, _describe(e))
                if status == 200 and b'"usage"' in data:
                    try:
                        attempts.usage = json.loads(data).get("usage")
                        metrics.observe_usage(url, predicted, attempts.usage)
                    except (ValueError, AttributeError):
                        pass
                    if attempts.follower is not None:
                        attempts.follower.body(data)
                attempts.answered = status == 200  # an error answer generated nothing
                await send({"type": "http.response.start", "status": status,
                            "headers": response_headers(resp.raw_headers, url, len(data), extra_headers)})
                await send({"type": "http.response.body", "body": data})
                ok = True
                return _Result(End.DONE, str(status))
            chunks = resp.content.iter_any()
            try:
                first = await anext(chunks, b"")
            except _UPSTREAM_ERRORS as e:
                metrics.upstream_failures.labels(url, "before-first-byte").inc()
                return _Result(End.READ, _describe(e))
            if not first:
                return _Result(End.READ, "empty response")
            usage = attempts.follower
            resume = attempts.resume
            progress = resume.progress() if resume is not None else None
            attempts.answered = True
            await send({"type": "http.response.start", "status": 200,
                        "headers": response_headers(resp.raw_headers, url, None, extra_headers)})
            out = first if progress is None else progress.feed(first)
            await send({"type": "http.response.body", "body": out if usage is None else usage.feed(out),
                        "more_body": True})
            if resume is not None:
                resume.last_at = time.perf_counter()
            if not _no_token(first):
                attempts.first_token_at = time.perf_counter()
                ls.first_token()
            saw_usage = False
            try:
                async for chunk in chunks:
                    if attempts.first_token_at is None and not _no_token(chunk):
                        attempts.first_token_at = time.perf_counter()
                        ls.first_token()
                    if not saw_usage and b'"usage"' in chunk:
                        got = _usage_from_sse(chunk)
                        if got is not None and got.get("prompt_tokens") is not None:
                            saw_usage = True
                            attempts.usage = got
                            metrics.observe_usage(url, predicted, got)
                    if progress is not None and resume is not None:
                        chunk = progress.feed(chunk)
                        resume.last_at = time.perf_counter()
                    if usage is not None:
                        chunk = usage.feed(chunk)
                    if not chunk:
                        continue
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except _UPSTREAM_ERRORS as e:
                metrics.upstream_failures.labels(url, "mid-stream").inc()
                log.warning("replica %s failed mid-stream: %s", url, _describe(e))
                if progress is not None:
                    return _Result(End.MID_STREAM, _describe(e), progress=progress)
                await send({"type": "http.response.body", "more_body": False,
                            "body": sse_error_event(f"replica {url} failed mid-stream ({_describe(e)}); "
                                                    "the response is incomplete")})
                return _Result(End.MID_STREAM, _describe(e))
            if progress is not None and not progress.done:  # an error event, or an end without [DONE]
                if progress.error is None or replica_failed(progress.error):
                    why = "error event" if progress.error is not None else "the stream ended without [DONE]"
                    metrics.upstream_failures.labels(url, "mid-stream").inc()
                    log.warning("replica %s failed mid-stream: %s", url, why)
                    return _Result(End.MID_STREAM, why, progress=progress)
                tail = b"data: " + json.dumps(progress.error).encode() + b"\n\ndata: [DONE]\n\n"  # the request's fault
                await send({"type": "http.response.body", "body": tail if usage is None else usage.feed(tail),
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"" if usage is None else usage.flush(),
                        "more_body": False})
            attempts.ended_at = time.perf_counter()
            if usage is not None and usage.last is not None:
                attempts.usage = usage.last
            ok = True
            return _Result(End.DONE, "200")
        finally:
            if ok:
                resp.release()
            else:
                resp.close()  # drop the connection: a cancelled stream makes the engine abort the request


_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


def _describe(e: BaseException) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__

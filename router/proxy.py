"""Streaming passthrough to the chosen replica (aiohttp), with retry-before-first-byte and clean failure.

- A request whose attempt fails before the replica sent any body byte (connection refused/reset, 502/503/504)
  is retried on another replica, up to `max_attempts` in all. Non-streamed responses are buffered, so they
  can be retried until the replica finished them.
- Streamed responses start once the replica sent its first body chunk; from then on bytes pass straight
  through. A replica that dies mid-stream ends the client's stream with an SSE error event and `[DONE]`.
- The caller cancels the task when the client disconnects; closing the upstream response closes its
  connection, and the engine aborts the request.
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp

from contract.errors import error_body, error_type
from router.errors import send_json
from router.prepare import PreparedRequest

log = logging.getLogger("kvfleet.router.proxy")

RETRY_STATUSES = (502, 503, 504)
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                         b"trailers", b"transfer-encoding", b"upgrade", b"host", b"content-length"})
_DROP_RESPONSE = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"date",
                            b"server"})


def forward_headers(raw_headers) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw_headers if k.lower() not in _HOP_BY_HOP]


def response_headers(raw_headers, replica: str, body_len: int | None) -> list[tuple[bytes, bytes]]:
    out = [(k, v) for k, v in raw_headers if k.lower() not in _DROP_RESPONSE]
    out.append((b"x-kvfleet-replica", replica.encode("latin-1")))
    if body_len is not None:
        out.append((b"content-length", str(body_len).encode()))
    return out


def sse_error_event(message: str) -> bytes:
    err = error_body(message, error_type(502), None, "upstream_failed")
    return b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"


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


class Proxy:
    """The data path. It uses aiohttp rather than httpx: on this path aiohttp's C parser costs ~0.4 ms per
    streamed request against ~1.2 ms for httpx (measured against loadtest/fake_engine.py), which decides
    whether one router process can pass 1,000 streamed requests/s."""

    def __init__(self, fleet, metrics, session: aiohttp.ClientSession, max_attempts: int):
        self.fleet = fleet
        self.metrics = metrics
        self.session = session
        self.max_attempts = max_attempts

    async def forward(self, send, path: str, body: bytes, headers, prep: PreparedRequest, decide) -> str:
        """Proxy one completion request; returns its final status label for the metrics."""
        fleet, metrics = self.fleet, self.metrics
        tried: set[str] = set()
        last_error = "no ready replica"
        fwd_headers = forward_headers(headers)
        for attempt in range(self.max_attempts):
            decision = decide(prep, tried)
            if decision is None:
                break
            url = decision.url
            st = fleet.replicas[url]
            tried.add(url)
            ticket = st.on_dispatch(max(prep.num_prompt_tokens - decision.predicted_cached_tokens, 0), fleet.clock())
            st.breaker.on_attempt(fleet.clock())
            fleet.record_routed(url, prep)
            kind = "aborted"
            try:
                kind, detail = await self._attempt(send, url, path, body, fwd_headers, prep, decision)
            finally:
                st.on_done(ticket)
                if kind == "aborted":  # the client went away (cancelled) or could not be written to
                    st.breaker.on_abandoned()
            if kind == "done":
                st.breaker.on_success()
                metrics.requests.labels(url, metrics.policy, detail).inc()
                return detail
            if kind == "mid-stream":
                st.breaker.on_failure(fleet.clock())
                metrics.requests.labels(url, metrics.policy, "error").inc()
                return "error"
            # failed before the first byte: retry elsewhere
            if kind != "unavailable":
                st.breaker.on_failure(fleet.clock())
            last_error = f"{url}: {detail}"
            metrics.requests.labels(url, metrics.policy, "retried").inc()
            if attempt + 1 < self.max_attempts:
                metrics.retries.labels(kind).inc()
        metrics.requests.labels("none", metrics.policy, "error").inc()
        await send_json(send, 503, error_body(f"no replica could serve the request ({last_error})",
                                              error_type(503), None, "no_replica_available"))
        return "error"

    async def _attempt(self, send, url: str, path: str, body: bytes, fwd_headers, prep, decision):
        metrics = self.metrics
        try:
            resp = await self.session.post(url + path, data=body, headers=fwd_headers)
        except _UPSTREAM_ERRORS as e:
            metrics.upstream_failures.labels(url, "connect").inc()
            return "connect", _describe(e)
        ok = False
        try:
            status = resp.status
            if status in RETRY_STATUSES:
                await resp.read()
                ok = True
                return ("unavailable" if status == 503 else "status"), f"HTTP {status}"
            if not (prep.stream and status == 200):
                try:
                    data = await resp.read()
                except _UPSTREAM_ERRORS as e:
                    metrics.upstream_failures.labels(url, "before-first-byte").inc()
                    return "read", _describe(e)
                if status == 200 and b'"usage"' in data:
                    try:
                        metrics.observe_usage(url, decision.predicted_cached_tokens, json.loads(data).get("usage"))
                    except ValueError:
                        pass
                await send({"type": "http.response.start", "status": status,
                            "headers": response_headers(resp.raw_headers, url, len(data))})
                await send({"type": "http.response.body", "body": data})
                ok = True
                return "done", str(status)
            chunks = resp.content.iter_any()
            try:
                first = await anext(chunks, b"")
            except _UPSTREAM_ERRORS as e:
                metrics.upstream_failures.labels(url, "before-first-byte").inc()
                return "read", _describe(e)
            if not first:
                return "read", "empty response"
            await send({"type": "http.response.start", "status": 200,
                        "headers": response_headers(resp.raw_headers, url, None)})
            await send({"type": "http.response.body", "body": first, "more_body": True})
            saw_usage = False
            try:
                async for chunk in chunks:
                    if not saw_usage and b'"usage"' in chunk:
                        usage = _usage_from_sse(chunk)
                        if usage is not None and usage.get("prompt_tokens") is not None:
                            saw_usage = True
                            metrics.observe_usage(url, decision.predicted_cached_tokens, usage)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except _UPSTREAM_ERRORS as e:
                metrics.upstream_failures.labels(url, "mid-stream").inc()
                log.warning("replica %s failed mid-stream: %s", url, _describe(e))
                await send({"type": "http.response.body", "more_body": False,
                            "body": sse_error_event(f"replica {url} failed mid-stream ({_describe(e)}); "
                                                    "the response is incomplete")})
                return "mid-stream", _describe(e)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            ok = True
            return "done", "200"
        finally:
            if ok:
                resp.release()
            else:
                resp.close()  # drop the connection: a cancelled stream makes the engine abort the request


_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


def _describe(e: BaseException) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__

"""Streaming passthrough to the chosen replica (httpx), with retry-before-first-byte and clean failure.

- A request whose attempt fails before the replica sent any body byte (connection refused/reset, 502/503/504)
  is retried on another replica, up to `max_attempts` in all. Non-streamed responses are buffered, so they
  can be retried until the replica finished them.
- Streamed responses start once the replica sent its first body chunk; from then on bytes pass straight
  through. A replica that dies mid-stream ends the client's stream with an SSE error event and `[DONE]`.
- The caller cancels the task when the client disconnects; closing the upstream response closes its
  connection, and the engine aborts the request.
"""

from __future__ import annotations

import json
import logging

import httpx

from router.errors import json_error, send_json
from router.prepare import PreparedRequest

log = logging.getLogger("kvfleet.router.proxy")

RETRY_STATUSES = (502, 503, 504)
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                         b"trailers", b"transfer-encoding", b"upgrade", b"host", b"content-length"})
_DROP_RESPONSE = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "date", "server"})


def forward_headers(raw_headers) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in raw_headers if k.lower() not in _HOP_BY_HOP]


def response_headers(resp: httpx.Response, replica: str, body_len: int | None) -> list[tuple[bytes, bytes]]:
    out = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in resp.headers.multi_items()
           if k.lower() not in _DROP_RESPONSE]
    out.append((b"x-kvfleet-replica", replica.encode("latin-1")))
    if body_len is not None:
        out.append((b"content-length", str(body_len).encode()))
    return out


def sse_error_event(message: str, code: int = 502) -> bytes:
    err = {"error": {"message": message, "type": "upstream_error", "param": None, "code": code}}
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
    def __init__(self, fleet, metrics, client: httpx.AsyncClient, max_attempts: int):
        self.fleet = fleet
        self.metrics = metrics
        self.client = client
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
            ticket = st.on_dispatch(max(prep.num_prompt_tokens - decision.predicted_cached_tokens, 0))
            st.breaker.on_attempt(fleet.clock())
            fleet.record_routed(url, prep)
            try:
                outcome = await self._attempt(send, url, path, body, fwd_headers, prep, decision)
            finally:
                st.on_done(ticket)
            kind, detail = outcome
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
        await send_json(send, 503, json_error(f"no replica could serve the request ({last_error})",
                                              "service_unavailable", 503))
        return "error"

    async def _attempt(self, send, url: str, path: str, body: bytes, fwd_headers, prep, decision):
        metrics = self.metrics
        req = self.client.build_request("POST", url + path, content=body, headers=fwd_headers)
        try:
            resp = await self.client.send(req, stream=True)
        except httpx.HTTPError as e:
            metrics.upstream_failures.labels(url, "connect").inc()
            return "connect", f"{type(e).__name__}: {e}"
        try:
            if resp.status_code in RETRY_STATUSES:
                await resp.aread()
                return ("unavailable" if resp.status_code == 503 else "status"), f"HTTP {resp.status_code}"
            chunks = resp.aiter_raw()
            if not (prep.stream and resp.status_code == 200):
                try:
                    data = await resp.aread()
                except httpx.HTTPError as e:
                    metrics.upstream_failures.labels(url, "before-first-byte").inc()
                    return "read", f"{type(e).__name__}: {e}"
                if resp.status_code == 200 and b'"usage"' in data:
                    try:
                        metrics.observe_usage(url, decision.predicted_cached_tokens, json.loads(data).get("usage"))
                    except ValueError:
                        pass
                await send({"type": "http.response.start", "status": resp.status_code,
                            "headers": response_headers(resp, url, len(data))})
                await send({"type": "http.response.body", "body": data})
                return "done", str(resp.status_code)
            try:
                first = await anext(chunks, b"")
            except httpx.HTTPError as e:
                metrics.upstream_failures.labels(url, "before-first-byte").inc()
                return "read", f"{type(e).__name__}: {e}"
            if not first:
                return "read", "empty response"
            await send({"type": "http.response.start", "status": 200,
                        "headers": response_headers(resp, url, None)})
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
            except httpx.HTTPError as e:
                metrics.upstream_failures.labels(url, "mid-stream").inc()
                log.warning("replica %s failed mid-stream: %s", url, e)
                await send({"type": "http.response.body", "more_body": False,
                            "body": sse_error_event(f"replica {url} failed mid-stream ({type(e).__name__}); "
                                                    "the response is incomplete")})
                return "mid-stream", str(e)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return "done", "200"
        finally:
            await resp.aclose()

"""SSEResponse on a raw ASGI call, with stand-in bodies timed to the millisecond (no model): the status line
waits for the first chunk or keep-alive, an APIError before then is an HTTP error with a JSON body, after a
keep-alive an SSE error event; keep-alives never cancel the body's pending step; a client that leaves while
nothing was sent closes the body."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from engine.server.errors import APIError
from engine.server.streaming import SSE_DONE, SSE_KEEPALIVE, sse_response


class Body:
    """A response body: each step sleeps, then returns its bytes or raises its error; records how it ended."""

    def __init__(self, *steps: tuple[float, bytes | Exception]):
        self.steps = list(steps)
        self.cancelled = 0
        self.closed = False

    def __aiter__(self) -> Body:
        return self

    async def __anext__(self) -> bytes:
        if not self.steps:
            raise StopAsyncIteration
        delay, item = self.steps.pop(0)
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if isinstance(item, Exception):
            raise item
        return item

    async def aclose(self) -> None:
        self.closed = True


def serve(body: Body, keepalive: float, disconnect_after: float | None = None) -> list[tuple[float, dict]]:
    """(seconds since the call, ASGI message) for every message the response sends."""

    async def run() -> list[tuple[float, dict]]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        sent: list[tuple[float, dict]] = []

        async def receive() -> dict:
            if disconnect_after is None:
                await asyncio.Event().wait()
            await asyncio.sleep(disconnect_after)
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append((loop.time() - t0, message))

        response = sse_response(body, {"X-Request-Id": "r-1"}, keepalive)
        await asyncio.wait_for(response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send), 10)
        return sent

    return asyncio.run(run())


def _start(sent) -> tuple[float, dict]:
    (start,) = [(t, m) for t, m in sent if m["type"] == "http.response.start"]
    assert sent[0][1] is start[1], "the status line goes out first"
    return start


def _headers(message: dict) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in message["headers"]}


def _bodies(sent) -> list[bytes]:
    return [m["body"] for _, m in sent if m["type"] == "http.response.body"]


def test_an_error_before_the_first_chunk_is_an_http_error_with_a_json_body():
    body = Body((0.05, APIError(500, "the model ran out of memory", None, "out_of_memory")))
    sent = serve(body, keepalive=1.0)
    _, start = _start(sent)
    headers = _headers(start)
    assert start["status"] == 500
    assert headers["content-type"] == "application/json" and headers["x-request-id"] == "r-1"
    assert json.loads(b"".join(_bodies(sent)))["error"] == {
        "message": "the model ran out of memory", "type": "internal_error", "param": None, "code": "out_of_memory"}
    assert body.closed


def test_error_headers_come_with_the_error():
    body = Body((0.0, APIError(503, "aborted", None, "aborted", {"Retry-After": "1"})))
    _, start = _start(serve(body, keepalive=0))
    assert start["status"] == 503 and _headers(start)["retry-after"] == "1"


def test_the_status_line_waits_for_the_first_chunk_when_keepalives_are_off():
    body = Body((0.3, b"data: 1\n\n"), (0.0, SSE_DONE))
    sent = serve(body, keepalive=0)
    t, start = _start(sent)
    assert t >= 0.3 and start["status"] == 200
    assert _headers(start)["content-type"].startswith("text/event-stream")
    assert _bodies(sent) == [b"data: 1\n\n", SSE_DONE, b""]
    assert body.closed and body.cancelled == 0


def test_keepalives_while_the_body_is_slow_never_cancel_its_pending_step():
    body = Body((0.45, b"data: 1\n\n"), (0.25, b"data: 2\n\n"), (0.0, SSE_DONE))
    sent = serve(body, keepalive=0.1)
    t, start = _start(sent)
    assert start["status"] == 200 and t < 0.3, "the first keep-alive sends the status line"
    bodies = _bodies(sent)
    first, second = bodies.index(b"data: 1\n\n"), bodies.index(b"data: 2\n\n")
    assert first >= 3 and set(bodies[:first]) == {SSE_KEEPALIVE}, bodies  # during the "prefill"
    assert second - first >= 2 and set(bodies[first + 1:second]) == {SSE_KEEPALIVE}, bodies  # between tokens
    assert bodies[second:] == [b"data: 2\n\n", SSE_DONE, b""]
    assert sent[-1][1]["more_body"] is False
    assert body.cancelled == 0 and body.closed


def test_an_error_after_a_keepalive_is_an_sse_error_event_then_done():
    body = Body((0.35, APIError(503, "the request was aborted", None, "aborted")))
    sent = serve(body, keepalive=0.1)
    _, start = _start(sent)
    assert start["status"] == 200
    bodies = _bodies(sent)
    assert bodies[0] == SSE_KEEPALIVE
    events = [e for e in b"".join(bodies).split(b"\n\n") if e.startswith(b"data: ")]
    assert json.loads(events[0][6:])["error"]["code"] == "aborted" and events[1] == b"data: [DONE]"
    assert body.closed


@pytest.mark.parametrize("keepalive", [0, 0.1])
def test_a_client_that_leaves_closes_the_body_at_once(keepalive):
    body = Body((5.0, b"data: never\n\n"))
    t0 = time.monotonic()
    sent = serve(body, keepalive=keepalive, disconnect_after=0.25)
    assert time.monotonic() - t0 < 2, "the body's 5 s step was not waited for"
    assert body.cancelled == 1 and body.closed
    assert all(m["type"] == "http.response.start" or m["body"] == SSE_KEEPALIVE for _, m in sent)
    if keepalive == 0:
        assert sent == [], "nothing was sent: no status line either"

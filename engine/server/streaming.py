"""Streaming responses that notice a client leaving at once, plus SSE framing.

Starlette's StreamingResponse only notices a disconnect on the next write when the server speaks
ASGI 2.4, so a request still queued or prefilling would run on after its client left. Here a
listener task waits for `http.disconnect` the whole time and cancels the stream; the body iterator
is always closed (its `finally` aborts the engine request) whether the stream ended, failed or was
cancelled. `watch_disconnect` does the same for non-streaming requests.

`SSEResponse` (an OpenAI stream) sends its status line with its first chunk, not before: a body that
raises APIError before its first chunk is answered with that status and a JSON error body. While the
body is slow to give its next chunk (queue wait, long prefill, between tokens), a `: keep-alive`
comment goes out every `keepalive` seconds (clients ignore comments); the first one sends the status
line (200), after which an APIError becomes an SSE error event followed by `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from contract.errors import error_body, error_type
from engine.server.errors import APIError, error_response

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"
SSE_KEEPALIVE = b": keep-alive\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def sse_error(err: APIError) -> bytes:
    return sse(error_body(err.message, error_type(err.status), err.param, err.code))


class ClientGone(Exception):
    """The client disconnected before the response was complete."""


class DisconnectAwareStreamingResponse(StreamingResponse):
    async def stream_response(self, send: Send) -> None:
        async with aclosing(self.body_iterator) as body:  # type: ignore[type-var]
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in body:
                if not isinstance(chunk, bytes | memoryview):
                    chunk = chunk.encode(self.charset)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def listen() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    break
            tg.cancel_scope.cancel()

        async def stream() -> None:
            try:
                await self.stream_response(send)
            except OSError:  # the socket went away mid-write
                pass
            tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(listen)
            tg.start_soon(stream)
        if self.background is not None:
            await self.background()


class SSEResponse(DisconnectAwareStreamingResponse):
    """An SSE stream whose status line waits for its first chunk or keep-alive (see the module's doc).
    keepalive: seconds without a chunk before a `: keep-alive` comment; 0 sends none."""

    def __init__(self, body: AsyncIterator[bytes], headers: dict[str, str], keepalive: float):
        super().__init__(body, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
        self.keepalive = keepalive
        self.error_headers = headers  # e.g. X-Request-Id, on an error answer too

    async def stream_response(self, send: Send) -> None:
        body = self.body_iterator
        started = False
        pending: asyncio.Future | None = None  # the body's next chunk, awaited across keep-alives

        async def write(data: bytes, more: bool = True) -> None:
            nonlocal started
            if not started:
                started = True
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": data, "more_body": more})

        try:
            while True:
                pending = asyncio.ensure_future(body.__anext__())
                while not (await asyncio.wait({pending}, timeout=self.keepalive or None))[0]:
                    await write(SSE_KEEPALIVE)
                got, pending = pending, None
                try:
                    chunk = got.result()
                except StopAsyncIteration:
                    break
                except APIError as e:
                    if not started:
                        await self._refuse(send, e)
                        return
                    await write(sse_error(e) + SSE_DONE)
                    break
                await write(chunk)
            await write(b"", more=False)
        finally:
            with anyio.CancelScope(shield=True):
                if pending is not None:  # cancelled while waiting (client gone): stop the body's step first
                    pending.cancel()
                    await asyncio.gather(pending, return_exceptions=True)
                await body.aclose()  # type: ignore[attr-defined]

    async def _refuse(self, send: Send, e: APIError) -> None:
        r = error_response(e.status, e.message, e.param, e.code, {**self.error_headers, **(e.headers or {})})
        await send({"type": "http.response.start", "status": r.status_code, "headers": r.raw_headers})
        await send({"type": "http.response.body", "body": r.body})


def sse_response(body: AsyncIterator[bytes], headers: dict[str, str], keepalive: float) -> SSEResponse:
    return SSEResponse(body, headers, keepalive)


async def watch_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)

    async def listen() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    listener = asyncio.ensure_future(listen())
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        raise ClientGone()
    finally:
        listener.cancel()
        if not task.done():  # we ourselves were cancelled
            task.cancel()

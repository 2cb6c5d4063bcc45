"""Streaming responses that notice a client leaving at once, plus SSE framing.

Starlette's StreamingResponse only notices a disconnect on the next write when the server speaks
ASGI 2.4, so a request still queued or prefilling would run on after its client left. Here a
listener task waits for `http.disconnect` the whole time and cancels the stream; the body iterator
is always closed (its `finally` aborts the engine request) whether the stream ended, failed or was
cancelled. `watch_disconnect` does the same for non-streaming requests.
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

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


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


def sse_response(body: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> StreamingResponse:
    return DisconnectAwareStreamingResponse(body, media_type="text/event-stream",
                                            headers={**SSE_HEADERS, **(headers or {})})


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

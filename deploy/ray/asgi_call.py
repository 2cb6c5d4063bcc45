"""Calling an ASGI app in-process, without a socket: how an engine replica under Ray Serve runs the engine's own
FastAPI app (engine/server/app.py) - the same validation, OpenAI formatting, SSE, errors and metrics as over
HTTP.

`Lifespan(app)` runs the app's startup and shutdown; `call(app, ...)` yields the response's `Head` (status and
headers) and then its body chunks as the app sends them. A consumer that stops early (the client went away)
makes the app see `http.disconnect`, which the engine server answers by aborting the request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from starlette.types import ASGIApp


@dataclass(frozen=True)
class Head:
    status: int
    headers: tuple[tuple[str, str], ...]

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k == name), None)


class Lifespan:
    """The ASGI lifespan protocol driven by hand: `await start()` returns once the app's startup is complete."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self._to_app: asyncio.Queue = asyncio.Queue()
        self._from_app: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        async def receive():
            return await self._to_app.get()

        async def send(message):
            await self._from_app.put(message)

        self._task = asyncio.ensure_future(self.app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                                                    receive, send))
        await self._to_app.put({"type": "lifespan.startup"})
        message = await self._from_app.get()
        if message["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"ASGI app startup failed: {message.get('message', message['type'])}")

    async def stop(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._to_app.put({"type": "lifespan.shutdown"})
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._from_app.get(), 30.0)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task


async def call(app: ASGIApp, method: str, path: str, body: bytes = b"",
               headers: Mapping[str, str] | None = None) -> AsyncIterator[Head | bytes]:
    """One HTTP request to `app`: yields a Head, then the non-empty body chunks."""
    raw_path, _, query = path.partition("?")
    hdrs = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    if body and not any(k == b"content-length" for k, _ in hdrs):
        hdrs.append((b"content-length", str(len(body)).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": raw_path, "raw_path": raw_path.encode(), "query_string": query.encode(),
             "root_path": "", "headers": hdrs, "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80),
             "state": {}}
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive():
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        await sent.put(message)

    async def run():
        try:
            await app(scope, receive, send)
        finally:
            await sent.put(None)  # the app returned (or failed): no more messages

    task = asyncio.ensure_future(run())
    try:
        while True:
            message = await sent.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                yield Head(message["status"], tuple((k.decode("latin-1").lower(), v.decode("latin-1"))
                                                    for k, v in message.get("headers", [])))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
        await task  # re-raises what the app raised
    finally:
        gone.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), 5.0)
            task.cancel()

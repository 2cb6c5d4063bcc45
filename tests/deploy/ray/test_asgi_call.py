"""Driving an ASGI app in-process (deploy/ray/asgi_call.py), as engine replicas under Ray Serve run the engine's
server: lifespan, status and headers, streamed chunks as they are sent, and a consumer that stops early making
the app see http.disconnect."""

import asyncio
import json
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from deploy.ray.asgi_call import Head, Lifespan, call


def make_app(events: list):
    @asynccontextmanager
    async def lifespan(app):
        events.append("startup")
        yield
        events.append("shutdown")

    async def echo(request: Request):
        body = await request.json()
        return JSONResponse({"got": body, "q": request.query_params.get("q"),
                             "session": request.headers.get("x-session-id")}, status_code=201)

    async def stream(request: Request):
        async def gen():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01)
            finally:
                events.append("stream closed")

        async def watch():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            events.append("disconnect seen")

        asyncio.ensure_future(watch())
        return StreamingResponse(gen(), media_type="text/event-stream")

    return Starlette(routes=[Route("/echo", echo, methods=["POST"]), Route("/stream", stream)], lifespan=lifespan)


def test_lifespan_request_and_early_stop():
    events: list = []
    app = make_app(events)

    async def main():
        life = Lifespan(app)
        await life.start()
        assert events == ["startup"]
        items = [x async for x in call(app, "POST", "/echo?q=1", json.dumps({"a": 1}).encode(),
                                       {"content-type": "application/json", "x-session-id": "s"})]
        head, *body = items
        assert isinstance(head, Head) and head.status == 201 and head.header("content-type") == "application/json"
        assert json.loads(b"".join(body)) == {"got": {"a": 1}, "q": "1", "session": "s"}
        got = []
        gen = call(app, "GET", "/stream")
        async for item in gen:
            got.append(item)
            if len(got) == 4:
                break
        await gen.aclose()
        assert got[0].status == 200 and got[1:] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
        for _ in range(100):
            if "stream closed" in events and "disconnect seen" in events:
                break
            await asyncio.sleep(0.01)
        assert "disconnect seen" in events and "stream closed" in events
        await life.stop()
        assert events[-1] == "shutdown"

    asyncio.run(main())

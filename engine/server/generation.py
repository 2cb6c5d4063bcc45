"""Running requests on the engine for the HTTP handlers: metrics, abort on exit, fan-in of batches.

`run` wraps `engine.generate`: it observes TTFT / inter-token / e2e / queue time, and whenever the
consumer stops early (client gone, drain timeout, error) it aborts the request on the engine so its
blocks are freed within one scheduler step. `merge` runs several requests (a batch of completion
prompts) concurrently and yields (prompt index, output) as they come.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

import anyio

from engine.async_engine import EngineDeadError
from engine.metrics import EngineMetrics
from engine.outputs import RequestOutput
from engine.server.errors import APIError

logger = logging.getLogger("kvfleet.server")


class Inflight:
    """Request ids the server is running, for drain and for the abort-all at the drain deadline."""

    def __init__(self) -> None:
        self.ids: set[str] = set()
        self.changed = asyncio.Event()

    def add(self, request_id: str) -> None:
        self.ids.add(request_id)

    def discard(self, request_id: str) -> None:
        self.ids.discard(request_id)
        self.changed.set()

    def __len__(self) -> int:
        return len(self.ids)

    async def wait_empty(self, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.ids:
            left = deadline - loop.time()
            if left <= 0:
                return False
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=min(left, 0.5))
            except asyncio.TimeoutError:
                pass
        return True


async def run(engine, prompt_ids: list[int], params, request_id: str, cache_salt: str | None,
              metrics: EngineMetrics, inflight: Inflight, arrival: float | None = None) -> AsyncIterator[RequestOutput]:
    """engine.generate with metrics; aborts the request unless it finished (always use aclosing).
    arrival: time.monotonic() when the HTTP request came in (TTFT and e2e count from there)."""
    timer = metrics.timer(arrival)
    finished = False
    inflight.add(request_id)
    try:
        prev_steps = 0
        async with aclosing(engine.generate(prompt_ids, params, request_id, cache_salt=cache_salt)) as gen:
            async for out in gen:
                steps = max((len(o.token_ids) for o in out.outputs), default=0)
                timer.on_output(steps - prev_steps, out)
                prev_steps = steps
                if out.finished:
                    finished = True
                    timer.finish(out.outputs[0].finish_reason if out.outputs else None)
                yield out
                if finished:
                    return
    finally:
        inflight.discard(request_id)
        if not finished:
            timer.finish("abort")
            with anyio.CancelScope(shield=True):
                try:
                    await engine.abort(request_id)
                except Exception:  # already gone: nothing to free
                    logger.debug("abort of %s after it ended", request_id, exc_info=True)


async def prime(gen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """Start `gen` now so the engine's up-front validation runs before a stream's headers go out:
    a request that can never run raises here (a proper 400) instead of inside the stream."""
    first = asyncio.ensure_future(gen.__anext__())
    for _ in range(3):  # generate() validates synchronously, before its first real await
        if first.done():
            break
        await asyncio.sleep(0)
    if first.done() and first.exception() is not None:
        await gen.aclose()
        raise first.exception()
    return _chain(first, gen)


async def _chain(first: asyncio.Future, gen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    try:
        try:
            item = await first
        except StopAsyncIteration:
            return
        yield item
        async for item in gen:
            yield item
    finally:
        if not first.done():
            first.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.wait([first])
            await gen.aclose()


def engine_error(e: BaseException) -> APIError:
    """The HTTP error for an exception out of the engine: 400 for requests it refuses, else 503."""
    if isinstance(e, ValueError):
        return APIError(400, str(e), getattr(e, "param", None) or getattr(e, "field", None), "invalid_value")
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the engine is not running: {e}", None, "engine_dead")
    logger.error("engine error", exc_info=e)
    return APIError(500, f"internal engine error: {type(e).__name__}", None, "internal_error")


async def merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams; closes all of them when the consumer stops."""
    if len(gens) == 1:
        async with aclosing(gens[0]) as g:
            async for out in g:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, g: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(g) as gg:
                async for out in gg:
                    await queue.put((i, out))
            await queue.put((i, done))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # hand the error to the consumer
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)

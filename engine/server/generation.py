"""Running requests on the engine for the HTTP handlers: metrics, abort on exit, fan-in of batches.

`start` adds a request through the engine's one admission edge (`EngineClient.add_request`, which raises
a typed error at once for a request that can never run) and wraps its delta stream in `Tracked`: it
observes TTFT / inter-token / e2e / queue time, and whenever the consumer stops early (client gone, drain
timeout, error) it aborts the request on the engine so its blocks are freed within one scheduler step.
`merge` runs several requests (a batch of completion prompts) concurrently and yields (prompt index,
delta) as they come.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import anyio

from engine.client import DeltaStream, EngineClient
from engine.outputs import RequestDelta
from engine.sampling_params import SamplingParams
from engine.server.metrics import EngineMetrics


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
            except TimeoutError:
                pass
        return True


class Tracked:
    """A request's delta stream with metrics, counted in flight from the start until it ends or is closed;
    closing it early (client gone, drain timeout, error) aborts the request on the engine."""

    def __init__(self, stream: DeltaStream, metrics: EngineMetrics, inflight: Inflight, arrival: float | None = None):
        self.request_id = stream.request_id
        self._stream = stream
        self._timer = metrics.timer(arrival)
        self._inflight = inflight
        self._reason: str | None = None  # the first completion's finish reason, once known
        inflight.add(self.request_id)

    def __aiter__(self) -> Tracked:
        return self

    async def __anext__(self) -> RequestDelta:
        try:
            delta = await self._stream.__anext__()
        except BaseException:
            await self.aclose()
            raise
        self._timer.on_output(max((len(o.token_ids) for o in delta.outputs), default=0), delta)
        for o in delta.outputs:
            if o.index == 0 and o.finish_reason is not None:
                self._reason = o.finish_reason
        if delta.finished:
            self._end()
        return delta

    async def aclose(self) -> None:
        if self._end():
            with anyio.CancelScope(shield=True):
                await self._stream.aclose()

    def _end(self) -> bool:
        """Count the request out (once); whether this call did."""
        if self.request_id not in self._inflight.ids:
            return False
        self._inflight.discard(self.request_id)
        self._timer.finish(self._reason or "abort")
        return True


def start(engine: EngineClient, prompt_ids: list[int], params: SamplingParams, request_id: str,
          cache_salt: str | None, metrics: EngineMetrics, inflight: Inflight, arrival: float | None) -> Tracked:
    """Add the request to the engine; its typed error at once if it can never run (no byte sent yet)."""
    return Tracked(engine.add_request(request_id, prompt_ids, params, cache_salt, arrival), metrics, inflight, arrival)


async def merge(gens: list[Tracked]) -> AsyncIterator[tuple[int, RequestDelta]]:
    """Interleave several delta streams; closes all of them when the consumer stops (or one fails)."""
    if len(gens) == 1:
        try:
            async for out in gens[0]:
                yield 0, out
        finally:
            await gens[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, g: Tracked) -> None:
        try:
            async for out in g:
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
            for g in gens:
                await g.aclose()


class ClosingBody:
    """A response body whose `aclose` also closes the request streams behind it, even when the body never
    started (a generator closed before its first step runs no `finally`): no request outlives its response."""

    def __init__(self, body: AsyncIterator[bytes], streams: list[Tracked]):
        self._body = body
        self._streams = streams

    def __aiter__(self) -> ClosingBody:
        return self

    async def __anext__(self) -> bytes:
        return await self._body.__anext__()

    async def aclose(self) -> None:
        try:
            await self._body.aclose()  # type: ignore[attr-defined]
        finally:
            await close_all(self._streams)


async def close_all(streams: list[Tracked]) -> None:
    """Close every stream (a no-op for those that ended), shielded from the caller's cancellation."""
    with anyio.CancelScope(shield=True):
        for s in streams:
            await s.aclose()

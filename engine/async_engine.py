"""The engine for the server: steps run in a background thread, requests are asyncio streams.

`add_request()` validates the request on the caller's thread (engine/admission.py) and raises a typed
error (engine/errors.py) at once if it can never run or the replica is full; otherwise the request is
queued for the engine thread and a `RequestStream` is returned, which yields a RequestDelta (only what is
new) after every step that produced something for it, merging deltas that piled up while its consumer
was busy. Closing the stream before the request finished aborts it; aborts and new requests are applied
by the engine thread before its next step, so an abort takes effect within one step. After each step the
thread drains the KV cache events and passes them, with the step's deltas, to the event loop in one
call; the loop keeps a mirror of the cached block hashes, so a new KV event subscriber gets a snapshot
and a sequence number consistent with the events that follow.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Sequence as Seq

from contract.kv_events import KVEvent
from engine.args import EngineArgs
from engine.errors import EngineDeadError, QueueFullError
from engine.llm_engine import EngineStats, LLMEngine
from engine.outputs import RequestDelta
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

KV_SUBSCRIBER_QUEUE = 65536  # a subscriber this far behind loses events (it sees a seq gap and resyncs)


class RequestStream:
    """One request's deltas in order (`async for`); `aclose()` before the end aborts the request."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str):
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self.finished:
            raise StopAsyncIteration
        delta = self._take(await self._queue.get())
        while not delta.finished and not self._queue.empty():  # the consumer lagged: one merged delta
            delta.merge(self._take(self._queue.get_nowait()))
        if delta.finished:
            self._end(abort=False)
        return delta

    async def aclose(self) -> None:
        self._end(abort=True)

    def put(self, item: RequestDelta | BaseException) -> None:
        self._queue.put_nowait(item)

    def _take(self, item: RequestDelta | BaseException) -> RequestDelta:
        if isinstance(item, BaseException):
            self._end(abort=False)
            raise item
        return item

    def _end(self, abort: bool) -> None:
        if not self.finished:
            self.finished = True
            self._engine._forget(self.request_id, abort)


class AsyncLLMEngine:
    def __init__(self, args: EngineArgs, engine: LLMEngine | None = None, max_queued_requests: int | None = None):
        """max_queued_requests: beyond max_num_seqs running plus this many, add_request raises QueueFullError."""
        self.args = args
        self.engine = engine or LLMEngine(args)
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self.limits = self.engine.limits
        self.hash_seed = self.engine.hash_seed
        self.grammars = self.engine.grammars  # compiles on its own worker thread (engine/structured/grammars.py)
        self.max_requests = None if max_queued_requests is None else args.max_num_seqs + max_queued_requests
        self._cv = threading.Condition()
        self._commands: list[tuple] = []  # ("add", seq) | ("abort", request_id), applied by the engine thread
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # running requests (loop thread only)
        self._subscribers: set[asyncio.Queue] = set()
        self._cached: dict[int, None] = {}  # mirror of the prefix cache's hashes, in insertion order
        self._last_event_seq = 0
        self.kv_events_published = 0
        self.dead: BaseException | None = None

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        kv = self.engine.kv
        self._cached = dict.fromkeys(kv.snapshot())
        self._last_event_seq = kv.last_event_seq
        kv.drain_events()  # covered by the snapshot
        self._thread = threading.Thread(target=self._run, name="kvfleet-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Abort whatever runs (its streams end with finish_reason "abort") and stop the engine thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        if self.dead is None:
            self.dead = EngineDeadError("the engine is shut down")

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self.dead is None

    # ---- requests ----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams,
                    cache_salt: str | None = None, arrival_time: float | None = None) -> RequestStream:
        """Validate and queue a request (raises InvalidRequestError, QueueFullError, EngineDeadError)."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine is not running: {self.dead}")
        if self._thread is None:
            raise EngineDeadError("the engine is not started; await start() first")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already running")
        if self.max_requests is not None and len(self._streams) >= self.max_requests:
            raise QueueFullError(f"this replica is at capacity ({len(self._streams)} requests in flight, at most "
                                 f"{self.max_requests}); retry shortly or on another replica")
        seq = self.engine.new_sequence(request_id, prompt_token_ids, params, cache_salt, arrival_time)
        stream = self._streams[request_id] = RequestStream(self, request_id)
        self._send(("add", seq))
        return stream

    @property
    def num_requests(self) -> int:
        """Requests added and not yet finished or closed."""
        return len(self._streams)

    def _forget(self, request_id: str, abort: bool) -> None:
        self._streams.pop(request_id, None)
        if abort:
            self._send(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with finish_reason "abort" after the engine's next step."""
        self._send(("abort", request_id))

    def _send(self, command: tuple) -> None:
        with self._cv:
            self._commands.append(command)
            self._cv.notify()

    # ---- KV events ---------------------------------------------------------------------------

    def subscribe_kv_events(self) -> tuple[list[int], int, asyncio.Queue]:
        """(hashes the prefix cache holds, the seq number they reflect, queue of the events after it)."""
        queue: asyncio.Queue = asyncio.Queue(maxsize=KV_SUBSCRIBER_QUEUE)
        self._subscribers.add(queue)
        return list(self._cached), self._last_event_seq, queue

    def unsubscribe_kv_events(self, queue: asyncio.Queue) -> None:
        self._subscribers.discard(queue)

    # ---- observability -----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return dataclasses.replace(self.engine.stats(), kv_events_published=self.kv_events_published)

    # ---- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cv:
                    while not (self._commands or self._stopping or engine.has_unfinished_requests()):
                        self._cv.wait()
                    commands, self._commands = self._commands, []
                    stopping = self._stopping
                outputs: list[RequestDelta] = []
                errors: list[tuple[str, BaseException]] = []
                for kind, arg in commands:
                    if kind == "add":
                        try:
                            engine.add_sequence(arg)
                        except Exception as e:  # noqa: BLE001 - reported to that request's iterator
                            errors.append((arg.request_id, e))
                    else:
                        out = engine.abort_request(arg)
                        if out is not None:
                            outputs.append(out)
                if stopping:
                    outputs.extend(engine.abort_all())
                elif engine.has_unfinished_requests():
                    outputs.extend(engine.step())
                self._publish(outputs, errors, engine.drain_kv_events())
                if stopping:
                    return
        except BaseException as e:  # the loop died: fail every request instead of hanging them
            logger.exception("engine loop failed")
            self.dead = e
            self._call_soon(self._fail_all, EngineDeadError(f"engine loop failed: {type(e).__name__}: {e}"))

    def _publish(self, outputs, errors, events: list[KVEvent]) -> None:
        if outputs or errors or events:
            self._call_soon(self._dispatch, outputs, errors, events)

    def _call_soon(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    # ---- on the event loop -------------------------------------------------------------------

    def _dispatch(self, outputs: list[RequestDelta], errors, events: list[KVEvent]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out if out.error is None else out.error)
        for rid, err in errors:
            stream = self._streams.get(rid)
            if stream is not None:
                stream.put(err)
        for ev in events:
            if ev.kind == "stored":
                self._cached.update(dict.fromkeys(ev.block_hashes))
            elif ev.kind == "removed":
                for h in ev.block_hashes:
                    self._cached.pop(h, None)
            else:
                self._cached.clear()
            self._last_event_seq = ev.seq
            for sub in self._subscribers:
                try:
                    sub.put_nowait(ev)
                except asyncio.QueueFull:  # the subscriber will see a gap and ask for a new snapshot
                    pass
        self.kv_events_published += len(events)

    def _fail_all(self, err: BaseException) -> None:
        for stream in self._streams.values():
            stream.put(err)

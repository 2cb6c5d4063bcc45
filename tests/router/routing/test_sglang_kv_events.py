"""SGLang's KV events into the exact prefix index. The frames (tests/router/routing/data/sglang_kv_events/) were encoded
and served by SGLang 0.5.23's own event classes and ZmqEventPublisher (record_frames.py there says why not by a
live engine: SGLang's CPU backend cannot be installed here), built page by page as its radix cache does."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgpack

from contract.hashing import DEFAULT_HASH_SEED
from deploy.ports import free_port
from router.routing.prefix_index import PrefixIndex, request_block_hashes
from router.routing.vllm_kv_events import VllmEventApplier, VllmKVSubscriber
from router.routing.vllm_kv_wire import END_SEQ, Cleared, Removed, Stored, decode_batch
from router.states import KVEventsState
from tests.router.routing.test_vllm_kv_events import FakeVllmPublisher, until

DATA = Path(__file__).parent / "data" / "sglang_kv_events"
R = "http://sglang-a:30000"
SEED = DEFAULT_HASH_SEED
REC = json.loads((DATA / "recording.json").read_text())
PAGE = REC["page_size"]
LIVE = msgpack.unpackb((DATA / "live.msgpack").read_bytes())
A, B, D = (REC["requests"][k] for k in "ABD")


def batches():
    return [decode_batch(seq, payload) for _, seq, payload in LIVE]


def matched(idx: PrefixIndex, prompt: list[int], salt: str | None = None) -> int:
    # one token more than the blocks: a hit never covers a prompt's last token
    return idx.matched_blocks(request_block_hashes([*prompt, 7], PAGE, SEED, salt), [R]).get(R, 0)


def counts(idx: PrefixIndex) -> dict[str, int]:
    return {"A": matched(idx, A), "B": matched(idx, B), "D": matched(idx, D, "tenant-a"), "D-unsalted": matched(idx, D)}


def test_sglang_frames_decode_with_its_own_fields():
    bs = batches()
    assert [t for t, _, _ in LIVE] == [b"kv"] * 8 and [b.seq for b in bs] == list(range(8))
    assert all(b.unknown == 0 for b in bs)
    a0, a1, a2 = bs[0].events  # one BlockStored per page, chained
    assert (a0.parent_block_hash, a1.parent_block_hash, a2.parent_block_hash) == (
        None, a0.block_hashes[0], a1.block_hashes[0])
    assert a0.token_ids == tuple(A[:PAGE]) and a0.block_size == PAGE and a0.medium == "GPU"
    (b,) = bs[1].events
    assert b.parent_block_hash == a1.block_hashes[0] and b.token_ids == tuple(B[2 * PAGE:])
    assert [e.cache_salt for e in bs[2].events] == ["tenant-a"] * 2  # SGLang sends the salt on every page
    (eagle,) = bs[3].events
    assert eagle.foreign_inputs and eagle.token_ids == ()
    assert bs[4].events == (Removed(a2.block_hashes, "GPU"), Removed(b.block_hashes, "GPU"))
    assert bs[5].events == (Removed(a0.block_hashes, "CPU_PINNED"),)
    assert bs[6].events == (Cleared(),) and isinstance(bs[7].events[0], Stored)


def test_replay_answers_are_the_live_batches():
    for start in (0, 3):
        msgs = msgpack.unpackb((DATA / f"replay_from_{start}.msgpack").read_bytes())
        assert msgs[-1] == [b"", b"", END_SEQ, b""]
        assert [decode_batch(m[2], m[3]) for m in msgs[:-1]] == batches()[start:]


def test_sglang_session_gives_kvfleet_hashes_and_exact_block_counts():
    idx = PrefixIndex()
    ap = VllmEventApplier(R, idx, SEED)
    seen = []
    for batch in batches():
        assert ap.apply(batch)
        seen.append(counts(idx))
    assert idx.params[R] == (PAGE, SEED)
    assert seen == [
        {"A": 3, "B": 2, "D": 0, "D-unsalted": 0},
        {"A": 3, "B": 3, "D": 0, "D-unsalted": 0},  # B's own page chained on A's page 1
        {"A": 3, "B": 3, "D": 2, "D-unsalted": 0},  # salted pages match salted requests only
        {"A": 3, "B": 3, "D": 2, "D-unsalted": 0},  # the bigram page: skipped
        {"A": 2, "B": 2, "D": 2, "D-unsalted": 0},  # A's leaf page and B's page evicted
        {"A": 2, "B": 2, "D": 2, "D-unsalted": 0},  # a host-tier removal does not touch the GPU blocks
        {"A": 0, "B": 0, "D": 0, "D-unsalted": 0},
        {"A": 3, "B": 2, "D": 0, "D-unsalted": 0},
    ]
    assert ap.skipped == {"foreign-inputs": 1, "medium": 1}


def test_subscriber_follows_sglang_frames_and_fills_a_gap_by_replay():
    payloads = [payload for _, _, payload in LIVE]

    async def main():
        pub_port, replay_port = free_port(), free_port()
        pub = FakeVllmPublisher(pub_port, replay_port)
        for seq in range(2):
            await pub.publish(seq, payloads[seq], live=False)
        idx = PrefixIndex()
        sub = VllmKVSubscriber(R, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", idx, SEED)
        task = asyncio.create_task(sub.run())
        try:
            await pub.subscribed()
            await until(lambda: sub.status is KVEventsState.LIVE)
            assert counts(idx)["B"] == 3
            await pub.publish(2, payloads[2], live=False)
            await pub.publish(3, payloads[3])
            await pub.publish(4, payloads[4])
            await until(lambda: sub.applier.last_seq == 4)
            assert pub.replays == [0, 2] and counts(idx) == {"A": 2, "B": 2, "D": 2, "D-unsalted": 0}
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await pub.close()

    asyncio.run(main())

"""AsyncLLMEngine on a tiny random Llama: concurrency, deltas, aborts, errors at add_request, KV events."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from engine.args import EngineArgs
from engine.async_engine import AsyncLLMEngine
from engine.errors import EngineDeadError, QueueFullError, RequestTooLongError
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model
from engine.model.registry import resolve_model
from engine.sampling_params import SamplingParams, SamplingParamsError
from tests.engine._tiny_llama import make_tiny_llama

PROMPTS = [[(i * 131 + j * 17) % 30000 + 5 for j in range(10 + 9 * i)] for i in range(8)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_llama(str(tmp_path_factory.mktemp("tiny")))
    return path, load_model(resolve_model(path), torch.float32, "cpu", 1024)


def _engine(tiny, max_queued_requests=None, **kw) -> AsyncLLMEngine:
    path, loaded = tiny
    args = EngineArgs(**{**dict(model=path, dtype="float32", num_blocks=64, max_num_seqs=8, max_model_len=1024,
                                num_threads=1), **kw})
    return AsyncLLMEngine(args, LLMEngine(args, loaded), max_queued_requests=max_queued_requests)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def _collect(eng, prompt, params, rid):
    outs = [out async for out in eng.add_request(rid, prompt, params)]
    return outs


def test_concurrent_requests_match_the_offline_engine(tiny):
    path, loaded = tiny
    offline = LLMEngine(EngineArgs(model=path, dtype="float32", num_blocks=64, num_threads=1), loaded)
    for i, p in enumerate(PROMPTS):
        offline.add_request(str(i), p, GREEDY)
    want = {str(i): [] for i in range(len(PROMPTS))}
    while offline.has_unfinished_requests():
        for out in offline.step():
            want[out.request_id] += out.outputs[0].token_ids

    async def main():
        eng = _engine(tiny)
        await eng.start()
        try:
            results = await asyncio.gather(*[_collect(eng, p, GREEDY, str(i)) for i, p in enumerate(PROMPTS)])
        finally:
            await eng.shutdown()
        return results, eng

    results, eng = run(main())
    for i, outs in enumerate(results):
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        assert all(o.outputs[0].token_ids for o in outs)  # every delta brings news
        assert [t for o in outs for t in o.outputs[0].token_ids] == want[str(i)] and len(want[str(i)]) == 12
    stats = eng.stats()
    assert stats.generation_tokens_total == 12 * len(PROMPTS) and stats.num_running == 0


def test_closing_the_iterator_aborts_within_a_step(tiny):
    async def main():
        eng = _engine(tiny)
        await eng.start()
        try:
            gen = eng.add_request("long", PROMPTS[3], SamplingParams(max_tokens=900, ignore_eos=True))
            seen = 0
            async for out in gen:
                seen += len(out.outputs[0].token_ids)
                if seen >= 2:
                    break
            await gen.aclose()
            deadline = time.monotonic() + 10
            while eng.stats().num_running and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            stats = eng.stats()
            assert stats.num_running == 0 and stats.kv_usage == 0.0
            assert stats.generation_tokens_total < seen + 5  # stopped right away, not after 900 tokens
        finally:
            await eng.shutdown()

    run(main())


def test_explicit_abort_ends_the_stream_with_abort(tiny):
    async def main():
        eng = _engine(tiny)
        await eng.start()
        try:
            outs = []
            async for out in eng.add_request("x", PROMPTS[0], SamplingParams(max_tokens=900, ignore_eos=True)):
                outs.append(out)
                if len(outs) == 1:
                    await eng.abort("x")
            assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
            # right away, not after 900 tokens: only the steps the core ran while the abort was on its way (the
            # tiny model steps in about a millisecond; CI saw 4 deltas) come before the final one
            assert len(outs) <= 8
        finally:
            await eng.shutdown()

    run(main())


def test_bad_requests_raise_at_add_request(tiny):
    async def main():
        eng = _engine(tiny, num_blocks=8)
        await eng.start()
        try:
            with pytest.raises(RequestTooLongError):
                eng.add_request("a", [5] * 100, SamplingParams(max_tokens=200))
            with pytest.raises(SamplingParamsError) as e:
                eng.add_request("b", [5], SamplingParams(n=9))
            assert e.value.param == "n" and eng.num_requests == 0
            assert eng.stats().num_waiting == 0
            outs = await _collect(eng, [5, 6, 7], GREEDY, "ok")  # the engine still serves
            assert outs[-1].finished
        finally:
            await eng.shutdown()
        with pytest.raises(EngineDeadError):
            eng.add_request("late", [5], GREEDY)

    run(main())


def test_shutdown_ends_running_streams(tiny):
    async def main():
        eng = _engine(tiny)
        await eng.start()
        gen = eng.add_request("s", PROMPTS[1], SamplingParams(max_tokens=900, ignore_eos=True))
        first = await gen.__anext__()
        assert not first.finished
        await eng.shutdown()
        rest = [out async for out in gen]
        assert rest and rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"

    run(main())


def test_kv_event_subscribers_get_a_consistent_snapshot_then_the_stream(tiny):
    async def main():
        eng = _engine(tiny, enable_prefix_caching=True)
        await eng.start()
        try:
            snap0, seq0, q = eng.subscribe_kv_events()
            assert snap0 == [] and seq0 == 0
            prompt = list(range(100, 140))  # 2 full blocks of 16 after prefill
            await _collect(eng, prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), "e1")
            events = []
            while not q.empty():
                events.append(q.get_nowait())
            assert events and events[0].kind == "stored" and events[0].parent_hash is None
            assert [e.seq for e in events] == list(range(1, len(events) + 1))
            stored = [h for e in events if e.kind == "stored" for h in e.block_hashes]
            assert len(stored) >= 2
            snap1, seq1, q2 = eng.subscribe_kv_events()
            assert seq1 == events[-1].seq and set(stored) <= set(snap1)
            eng.unsubscribe_kv_events(q)
            out = await _collect(eng, prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), "e2")
            assert out[-1].num_cached_tokens == 32
            assert q.empty()  # unsubscribed
            assert eng.stats().kv_events_published == seq1 + q2.qsize()
        finally:
            await eng.shutdown()

    run(main())


def test_a_lagging_consumer_gets_the_missed_deltas_merged(tiny):
    async def main():
        eng = _engine(tiny)
        await eng.start()
        try:
            stream = eng.add_request("lag", PROMPTS[2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                                       logprobs=1))
            first = await stream.__anext__()
            deadline = time.monotonic() + 30
            while eng.stats().num_running and time.monotonic() < deadline:  # let the rest pile up
                await asyncio.sleep(0.01)
            rest = [d async for d in stream]
            assert len(rest) == 1 and rest[0].finished  # eleven steps, one merged delta
            merged = rest[0].outputs[0]
            assert len(first.outputs[0].token_ids) + len(merged.token_ids) == 12
            assert [lp.token_id for lp in merged.logprobs] == merged.token_ids
            assert merged.finish_reason == "length"
        finally:
            await eng.shutdown()

    run(main())


def test_a_full_replica_refuses_at_add_request_and_takes_requests_again_after(tiny):
    async def main():
        eng = _engine(tiny, max_queued_requests=1, max_num_seqs=2, max_num_batched_tokens=64)
        await eng.start()
        try:
            long = SamplingParams(max_tokens=900, ignore_eos=True)
            streams = [eng.add_request(str(i), PROMPTS[0], long) for i in range(3)]
            with pytest.raises(QueueFullError, match="at most 3"):
                eng.add_request("over", PROMPTS[0], long)
            await streams[0].aclose()  # a closed stream frees its place at once
            streams.append(eng.add_request("again", PROMPTS[0], long))
            for s in streams:
                await s.aclose()
            assert eng.num_requests == 0
        finally:
            await eng.shutdown()

    run(main())


def test_a_lower_tier_is_announced_and_snapshotted_with_its_medium(tiny):
    """A pool of 8 blocks: the second prompt evicts the first's blocks into the host-memory tier (a `removed`
    event, then `stored` with medium CPU); the snapshot a new subscriber gets lists them under CPU; the first prompt
    again finds them reloaded (cached tokens), the same tokens as the first time."""
    async def main():
        eng = _engine(tiny, enable_prefix_caching=True, num_blocks=8, kv_tier_gib=0.01)
        await eng.start()
        try:
            first = list(range(100, 165))  # 4 full blocks of 16
            greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
            a = await _collect(eng, first, greedy, "t1")
            await _collect(eng, list(range(300, 420)), greedy, "t2")  # 8 blocks: all of the first's go
            _, _, q = eng.subscribe_kv_events()
            tiers = dict(eng.tier_snapshot())
            assert set(tiers) == {"CPU"} and len(tiers["CPU"]) == 4
            again = await _collect(eng, first, greedy, "t3")
            assert again[-1].num_cached_tokens == 64
            assert [t for d in again for c in d.outputs for t in c.token_ids] == \
                [t for d in a for c in d.outputs for t in c.token_ids]
            assert eng.stats().tier_reloaded_blocks == 4 and eng.stats().tier_spilled_blocks >= 4
        finally:
            await eng.shutdown()

    run(main())


def test_transfers_wait_for_room_in_the_arena_and_hand_every_region_back(tiny, monkeypatch):
    """An arena that holds one transfer at a time: concurrent exports and imports queue for it, each gets its
    own payload intact, a caller that gives up does not free a region the core may still write, and every byte
    is back with the front end at the end."""
    import engine.core.thread
    from engine.core.arena import ALIGN

    async def main():
        eng = _engine(tiny, enable_prefix_caching=True)
        per = eng.kv_layout.block_bytes
        monkeypatch.setattr(engine.core.thread, "ARENA_BYTES", -(-2 * per // ALIGN) * ALIGN)
        small = _engine(tiny, enable_prefix_caching=True)  # its arena holds two blocks
        await eng.start()
        await small.start()
        try:
            prompt = list(range(100, 165))  # 4 full blocks of 16
            await _collect(eng, prompt, GREEDY, "src")
            hashes = eng.subscribe_kv_events()[0][:4]  # the prompt's 4 blocks, in chain order
            whole = await eng.export_blocks(hashes, 4)
            assert len(whole.hashes) == 4 and len(whole.payload) == 4 * per
            await _collect(small, prompt, GREEDY, "src")
            parts = await asyncio.gather(*(small.export_blocks(hashes[i:], 4) for i in range(3)))
            assert [len(p.hashes) for p in parts] == [2, 2, 2]  # at most what the arena holds, each
            for i, p in enumerate(parts):
                assert p.payload == whole.payload[i * per:(i + 2) * per]
            waiter = asyncio.ensure_future(small.export_blocks(hashes, 2))
            await asyncio.sleep(0)
            waiter.cancel()  # given up on: its region comes back when the core answers, not now
            await asyncio.gather(waiter, return_exceptions=True)
            got = await small.export_blocks(hashes[2:], 2)
            assert got.payload == whole.payload[2 * per:]
            assert small._regions.used_bytes == 0 and eng._regions.used_bytes == 0
        finally:
            await eng.shutdown()
            await small.shutdown()

    run(main())

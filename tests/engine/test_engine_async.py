"""AsyncLLMEngine on a tiny random Llama: concurrency, aborts, errors before the first output, KV events."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from engine.args import EngineArgs
from engine.async_engine import AsyncLLMEngine, EngineDeadError
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model
from engine.model.registry import resolve_model
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.scheduler import RequestTooLongError
from tests.engine._tiny_llama import make_tiny_llama

PROMPTS = [[(i * 131 + j * 17) % 30000 + 5 for j in range(10 + 9 * i)] for i in range(8)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_llama(str(tmp_path_factory.mktemp("tiny")))
    return path, load_model(resolve_model(path), torch.float32, "cpu", 1024)


def _engine(tiny, **kw) -> AsyncLLMEngine:
    path, loaded = tiny
    args = EngineArgs(**{**dict(model=path, dtype="float32", num_blocks=64, max_num_seqs=8, max_model_len=1024,
                                num_threads=1), **kw})
    return AsyncLLMEngine(args, LLMEngine(args, loaded))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def _collect(eng, prompt, params, rid):
    outs = [out async for out in eng.generate(prompt, params, rid)]
    return outs


def test_concurrent_requests_match_the_offline_engine(tiny):
    path, loaded = tiny
    offline = LLMEngine(EngineArgs(model=path, dtype="float32", num_blocks=64, num_threads=1), loaded)
    for i, p in enumerate(PROMPTS):
        offline.add_request(str(i), p, GREEDY)
    want = {}
    while offline.has_unfinished_requests():
        for out in offline.step():
            if out.finished:
                want[out.request_id] = out.outputs[0].token_ids

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
        counts = [len(o.outputs[0].token_ids) for o in outs]
        assert counts == sorted(counts) and counts[-1] == 12
        assert outs[-1].outputs[0].token_ids == want[str(i)]
    stats = eng.stats()
    assert stats.generation_tokens_total == 12 * len(PROMPTS) and stats.num_running == 0


def test_closing_the_iterator_aborts_within_a_step(tiny):
    async def main():
        eng = _engine(tiny)
        await eng.start()
        try:
            gen = eng.generate(PROMPTS[3], SamplingParams(max_tokens=900, ignore_eos=True), "long")
            seen = 0
            async for out in gen:
                seen = len(out.outputs[0].token_ids)
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
            async for out in eng.generate(PROMPTS[0], SamplingParams(max_tokens=900, ignore_eos=True), "x"):
                outs.append(out)
                if len(outs) == 1:
                    await eng.abort("x")
            assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
            assert len(outs) <= 3
        finally:
            await eng.shutdown()

    run(main())


def test_bad_requests_raise_before_the_first_output(tiny):
    async def main():
        eng = _engine(tiny, num_blocks=8)
        await eng.start()
        try:
            with pytest.raises(RequestTooLongError):
                await eng.generate([5] * 100, SamplingParams(max_tokens=200), "a").__anext__()
            with pytest.raises(SamplingParamsError) as e:
                await eng.generate([5], SamplingParams(n=9), "b").__anext__()
            assert e.value.param == "n"
            assert eng.stats().num_waiting == 0
            outs = await _collect(eng, [5, 6, 7], GREEDY, "ok")  # the engine still serves
            assert outs[-1].finished
        finally:
            await eng.shutdown()
        with pytest.raises(EngineDeadError):
            await eng.generate([5], GREEDY, "late").__anext__()

    run(main())


def test_shutdown_ends_running_streams(tiny):
    async def main():
        eng = _engine(tiny)
        await eng.start()
        gen = eng.generate(PROMPTS[1], SamplingParams(max_tokens=900, ignore_eos=True), "s")
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

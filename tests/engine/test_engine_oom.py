"""Out-of-memory recovery and the fault-injection flags, on the bundled SmolLM2 in bf16 under --deterministic (a
request's tokens do not depend on the smaller steps a recovery makes, so a run with failures must equal one without).

--debug-oom-every N makes every Nth model step raise MemoryError inside the model runner, so these tests
go through the real recovery path: the failed step advances nothing, later steps are smaller, greedy
outputs equal those of a run without failures, and no KV block stays held. A request that fails alone
again and again ends with RequestOutOfMemoryError instead of looping.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from engine.args import EngineArgs
from engine.async_engine import AsyncLLMEngine
from engine.errors import RequestOutOfMemoryError
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model
from engine.model.registry import resolve_model
from engine.oom_backoff import GIVE_UP_AFTER
from engine.sampling_params import SamplingParams

MAX_LEN = 512
PROMPTS = [[(i * 131 + j * 17) % 40000 + 5 for j in range(6 + 11 * i)] for i in range(6)]  # 6..61 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    return load_model(resolve_model("smollm2"), torch.bfloat16, "cpu", MAX_LEN)


def _engine(loaded, **kw) -> LLMEngine:
    args = dict(model="smollm2", dtype="bfloat16", deterministic=True, max_model_len=MAX_LEN, num_blocks=64, max_num_seqs=4, seed=0,
                num_threads=1)
    return LLMEngine(EngineArgs(**{**args, **kw}), loaded)


def _run(eng: LLMEngine, prompts, params=GREEDY) -> dict[str, list[int]]:
    """Every request's tokens (by completion index for n > 1); the last delta of each request, by id."""
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    tokens: dict[str, list[int]] = {}
    for _ in range(2000):
        if not eng.has_unfinished_requests():
            return tokens
        for d in eng.step():
            assert d.error is None, d.error
            for o in d.outputs:
                tokens.setdefault(f"{d.request_id}/{o.index}", []).extend(o.token_ids)
    raise AssertionError("the engine did not finish")


def _all_blocks_free(eng: LLMEngine) -> bool:
    return eng.kv.num_free_blocks == eng.kv.num_blocks and eng.kv.stats().num_used_blocks == 0


@pytest.fixture(scope="module")
def reference(loaded) -> dict[str, list[int]]:
    eng = _engine(loaded)
    out = _run(eng, PROMPTS)
    assert eng.oom_events == 0 and len(out) == len(PROMPTS) and all(len(t) == 10 for t in out.values())
    return out


@pytest.mark.parametrize("every", [2, pytest.param(3, marks=pytest.mark.slow), 5])
def test_a_batch_with_failing_steps_gives_the_tokens_of_a_run_without(loaded, reference, every):
    eng = _engine(loaded, debug_oom_every=every)
    assert _run(eng, PROMPTS) == reference
    steps = eng.runner.num_model_steps
    assert eng.oom_events == steps // every >= 3
    assert eng.stats().oom_events == eng.oom_events
    assert eng.scheduler.oom.token_budget < 2048  # later steps were smaller
    assert _all_blocks_free(eng) and not eng.scheduler.has_unfinished()


class FailsOnce:
    """The model, except that its forward pass number `at` raises CUDA's out-of-memory error."""

    def __init__(self, model, at: int):
        self.model, self.config, self.at, self.calls = model, model.config, at, 0

    def __call__(self, *args):
        self.calls += 1
        if self.calls == self.at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.model(*args)


def test_cuda_out_of_memory_in_the_forward_pass_is_recovered_too(loaded, reference):
    eng = _engine(loaded)
    eng.runner.model = FailsOnce(eng.runner.model, at=3)
    assert _run(eng, PROMPTS) == reference
    assert eng.oom_events == 1 and _all_blocks_free(eng)


def test_a_failed_step_after_a_fork_preempts_the_half_copied_sequences(loaded):
    """n = 3 shares the prompt's partial last block; the first decode copies it for two of the three: when that
    step fails, the copies may be half done, so those two recompute; the tokens stay those of a clean run."""
    params = SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True)
    clean = _run(_engine(loaded), [PROMPTS[2]], params)
    eng = _engine(loaded)
    eng.add_request("0", PROMPTS[2], params)
    first = eng.step()  # prefill, fork, first token of each completion
    eng.runner.debug_oom_every = eng.runner.num_model_steps + 1  # the next model step fails
    preemptions = eng.kv.num_preemptions
    assert eng.step() == [] and eng.oom_events == 1
    assert eng.kv.num_preemptions == preemptions + 2
    eng.runner.debug_oom_every = 0
    tokens = {f"0/{o.index}": list(o.token_ids) for o in first[0].outputs}
    while eng.has_unfinished_requests():
        for d in eng.step():
            for o in d.outputs:
                tokens[f"0/{o.index}"] += o.token_ids
    assert tokens == clean
    assert _all_blocks_free(eng)


def test_a_request_that_always_runs_out_of_memory_ends_with_an_error(loaded):
    eng = _engine(loaded, debug_oom_every=1)
    eng.add_request("lone", PROMPTS[5], GREEDY)
    outs = []
    for _ in range(GIVE_UP_AFTER):
        assert not outs
        outs = eng.step()
    (last,) = outs
    assert last.request_id == "lone" and last.finished and isinstance(last.error, RequestOutOfMemoryError)
    assert last.outputs[0].finish_reason == "abort" and "out of memory" in str(last.error)
    assert eng.oom_events == GIVE_UP_AFTER
    assert not eng.has_unfinished_requests() and _all_blocks_free(eng)
    eng.runner.debug_oom_every = 0  # memory is back: the engine serves again
    assert _run(eng, PROMPTS[:1])["0/0"] == _run(_engine(loaded), PROMPTS[:1])["0/0"]


def test_the_async_engine_ends_the_stream_with_the_error_and_keeps_serving(loaded):
    async def main():
        core = _engine(loaded, debug_oom_every=1)
        eng = AsyncLLMEngine(core.args, core)
        await eng.start()
        try:
            with pytest.raises(RequestOutOfMemoryError):
                async for _ in eng.add_request("lone", PROMPTS[1], GREEDY):
                    pass
            assert eng.num_requests == 0 and eng.is_running
            assert eng.stats().oom_events == GIVE_UP_AFTER and eng.stats().kv_usage == 0.0
        finally:
            await eng.shutdown()

    asyncio.run(asyncio.wait_for(main(), 120))


def test_the_step_delay_makes_every_step_at_least_that_long(loaded):
    eng = _engine(loaded, debug_step_delay_ms=60)
    for i, p in enumerate(PROMPTS[:2]):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    durations = []
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        eng.step()
        durations.append(time.perf_counter() - t0)
    assert len(durations) >= 3 and min(durations) >= 0.060


def test_gpu_memory_is_reported_only_on_cuda(loaded):
    stats = _engine(loaded).stats()
    assert stats.gpu_memory_used_bytes is None and stats.oom_events == 0

"""--deterministic in process: a request's tokens and logprobs bit for bit the same whatever shares its steps
(alone, among 7 and among 63 others of mixed lengths) and whatever the prefix cache held (cold, warm, partly
evicted, reloaded from the lower tier), for greedy and seeded sampling, in float32 and bf16 (the tiny model has
no exact 4-bit groups: f32_linear and bf16_linear serve it; the bundled model's 4/8-bit kernels are covered
over HTTP in tests/router/test_deterministic_fleet.py and by tests/engine/model/test_one_set_of_weights.py).
Without the flag the same requests keep their greedy tokens (what default mode promises)."""

from __future__ import annotations

import random

import pytest
import torch

from contract.errors import ConfigError
from engine.kernels import cpu_ops
from engine.llm import LLM
from engine.model.loader import load_model
from engine.model.registry import resolve_model
from engine.sampling_params import SamplingParams
from tests.engine._tiny_llama import make_tiny_llama

pytestmark = pytest.mark.skipif(not cpu_ops.load(), reason="the fused CPU kernels do not build here")

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=41, max_tokens=10, ignore_eos=True, logprobs=3)
PROBE_LEN = 300


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny_det")))


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def loaded(request, tiny):
    return request.param, load_model(resolve_model(tiny), request.param, "cpu", 1024)


def _llm(tiny, loaded, **kw) -> LLM:
    dtype, model = loaded
    args = dict(dtype="float32" if dtype == torch.float32 else "bfloat16", num_blocks=1024, max_num_seqs=64,
                max_model_len=1024, seed=0, num_threads=2, deterministic=True)
    args.update(kw)
    return LLM(tiny, loaded_model=model, **args)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


PROBE = _prompt(random.Random(7), PROBE_LEN)


def _run(llm: LLM, params: SamplingParams, others: int, seed: int = 0) -> tuple[list[int], list]:
    """The probe's tokens and logprobs (each token's and its top 3), run beside `others` requests."""
    rng = random.Random(seed)
    prompts = [PROBE] + [_prompt(rng, rng.randrange(3, 500)) for _ in range(others)]
    side = [SamplingParams(temperature=0.8, max_tokens=rng.randrange(1, 24), ignore_eos=True) for _ in range(others)]
    out = llm.generate(prompts, [params] + side)[0].outputs[0]
    return out.token_ids, [(lp.logprob, list(lp.top)) for lp in out.logprobs]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_alone_among_others_cold_and_warm_bit_for_bit(tiny, loaded, params):
    llm = _llm(tiny, loaded)
    cold = _run(llm, params, 0)
    assert len(cold[0]) == 10
    assert _run(llm, params, 0) == cold  # warm: the prompt's blocks from the prefix cache, a short prefill
    assert _run(llm, params, 7, seed=1) == cold
    assert _run(llm, params, 63, seed=2) == cold
    eng = llm.engine
    assert eng.kv.prefix_hits_tokens > 0 and eng.kv.num_free_blocks == eng.kv.num_blocks


@pytest.mark.parametrize("tier", [False, True], ids=["evicted", "lower-tier"])
def test_after_an_eviction_and_from_the_lower_tier_bit_for_bit(tiny, loaded, tier):
    # 48 blocks of 16: the probe (19 blocks) and what runs beside it do not all stay cached
    llm = _llm(tiny, loaded, num_blocks=48, max_num_seqs=4, kv_tier_gib=0.05 if tier else 0.0)
    cold = _run(llm, SEEDED, 0)
    rng = random.Random(10)
    for _ in range(3):  # other prompts push the probe's blocks out, tail first
        llm.generate([_prompt(rng, 400) for _ in range(2)], GREEDY)
    eng = llm.engine
    assert eng.kv.evictions > 0
    assert _run(llm, SEEDED, 0) == cold
    if tier:
        assert eng.stats().tier_reloaded_blocks > 0


def test_two_engines_of_the_same_build_agree_bit_for_bit(tiny, loaded):
    first = _run(_llm(tiny, loaded, num_threads=1), SEEDED, 5, seed=3)
    assert _run(_llm(tiny, loaded, num_threads=2, max_num_batched_tokens=64), SEEDED, 9, seed=4) == first


def test_default_mode_keeps_greedy_tokens_and_shares_the_model_untouched(tiny, loaded):
    det = _llm(tiny, loaded)
    default = _llm(tiny, loaded, deterministic=False)
    want = _run(det, GREEDY, 0)[0]
    assert _run(default, GREEDY, 0)[0] == want and _run(default, GREEDY, 63, seed=5)[0] == want
    assert det.engine.model is not default.engine.model  # the deterministic engine swapped a copy's modules
    assert det.engine.stats().deterministic and not default.engine.stats().deterministic


def test_what_the_mode_does_not_cover_is_refused_naming_the_flag(tiny, loaded):
    for bad in (dict(attention_backend="torch"), dict(enable_lora=True)):
        with pytest.raises(ConfigError) as e:
            _llm(tiny, loaded, **bad)
        assert "--deterministic" in str(e.value)

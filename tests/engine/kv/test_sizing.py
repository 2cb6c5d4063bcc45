"""KV cache sizing: the arithmetic with exact expectations, the profiled step (run here on the CPU), and the
engine's INFO line."""

from __future__ import annotations

import logging

import pytest
import torch

from contract.errors import ConfigError
from engine.kv.sizing import GIB, MemoryProfile, plan_fixed, plan_from_profile, profile_batch_lengths

MIB = 1 << 20


def test_gpu_plan_takes_the_fraction_minus_weights_activations_and_reserve():
    p = MemoryProfile(total=80 * GIB, fraction=0.9, weights=16 * GIB, activations=2 * GIB, reserve=1 * GIB)
    plan = plan_from_profile(p, 2 * MIB)
    assert plan.kv_bytes == 53 * GIB and plan.num_blocks == 53 * 512 and plan.limited_by == "--gpu-memory-fraction"
    assert plan.line == ("KV cache sizing (GPU): total 80.00 GiB x 0.9 = 72.00 GiB - weights 16.00 GiB - activations "
                         "peak 2.00 GiB - reserve 1.00 GiB = 53.00 GiB; KV 53.00 GiB (limited by "
                         "--gpu-memory-fraction) / 2097152 B per block = 27136 blocks")


def test_gpu_plan_never_counts_on_more_than_is_free():
    p = MemoryProfile(total=80 * GIB, fraction=0.9, weights=16 * GIB, activations=2 * GIB, reserve=0, free=40 * GIB)
    plan = plan_from_profile(p, 2 * MIB)
    assert plan.kv_bytes == 38 * GIB and plan.num_blocks == 38 * 512 and plan.limited_by == "free memory"
    assert "free after profiling 40.00 GiB - activations peak = 38.00 GiB" in plan.line
    roomy = plan_from_profile(MemoryProfile(80 * GIB, 0.9, 16 * GIB, 2 * GIB, 0, free=70 * GIB), 2 * MIB)
    assert roomy.kv_bytes == 54 * GIB and roomy.limited_by == "--gpu-memory-fraction"


def test_two_replicas_sharing_a_device_each_size_from_their_own_fraction():
    """Both start on an empty 80 GiB device and see the same free memory; their fractions keep them apart."""
    plans = [plan_from_profile(MemoryProfile(80 * GIB, 0.45, 4 * GIB, 1 * GIB, 0, free=79 * GIB), 2 * MIB)
             for _ in range(2)]
    assert [p.kv_bytes for p in plans] == [31 * GIB, 31 * GIB]
    assert sum(p.kv_bytes + 4 * GIB + 1 * GIB for p in plans) <= 0.9 * 80 * GIB


def test_gpu_plan_without_room_for_one_block_names_the_flag():
    with pytest.raises(ConfigError) as e:
        plan_from_profile(MemoryProfile(16 * GIB, 0.5, 8 * GIB, 1 * GIB, 0), 2 * MIB)
    assert e.value.field == "--gpu-memory-fraction" and "weights 8.00 GiB" in str(e.value)


def test_fixed_plan_states_the_cpu_rule():
    plan = plan_fixed(2 * GIB, 98304, weights=GIB // 4, total=16 * GIB, explicit=False)
    assert plan.num_blocks == 21845 and plan.limited_by == "CPU default"
    assert plan.line == ("KV cache sizing (fixed, CPU default): total 16.00 GiB, weights 0.25 GiB, activations peak "
                         "not profiled, reserve none; KV 2.00 GiB / 98304 B per block = 21845 blocks")
    with pytest.raises(ConfigError, match="--kv-cache-memory"):
        plan_fixed(1000, 98304, weights=0, total=None, explicit=True)


@pytest.mark.parametrize("budget,seqs,max_len,expected", [
    (2048, 128, 4096, [1921] + [1] * 127),
    (2048, 4, 512, [512, 512, 512, 512]),
    (100, 200, 1000, [1] * 100),
    (10, 3, 4, [4, 4, 2]),
])
def test_profile_batch_fills_the_token_budget(budget, seqs, max_len, expected):
    lengths = profile_batch_lengths(budget, seqs, max_len)
    assert lengths == expected
    assert sum(lengths) == min(budget, len(lengths) * max_len)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from tests.engine._tiny_llama import make_tiny_llama
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny")))


def test_profile_step_runs_the_full_budget_through_model_and_sampler(tiny):
    from engine.attention import get_attention_backend
    from engine.memory_profile import run_profile_step
    from engine.model.loader import load_model
    from engine.model.registry import resolve_model
    from engine.model_runner import kv_bytes_per_token

    model, _ = load_model(resolve_model(tiny), torch.float32, "cpu", 256)
    lengths = profile_batch_lengths(300, 8, 256)
    assert lengths == [256, 38, 1, 1, 1, 1, 1, 1]
    with torch.inference_mode():
        kv_bytes, sampled = run_profile_step(model, get_attention_backend("torch"), torch.device("cpu"), 16, lengths)
    assert sampled == 8
    assert kv_bytes == (16 + 3 + 6) * 16 * kv_bytes_per_token(model.config, torch.float32)


@pytest.mark.parametrize("kv_gib,rule", [(None, "CPU default"), (0.01, "--kv-cache-memory")])
def test_engine_logs_the_sizing_arithmetic(tiny, caplog, kv_gib, rule):
    from engine.llm import LLM
    from engine.model_runner import kv_bytes_per_token

    with caplog.at_level(logging.INFO, logger="engine.llm_engine"):
        llm = LLM(tiny, dtype="float32", kv_cache_memory=kv_gib, max_num_seqs=2, max_model_len=64, num_threads=1)
    eng = llm.engine
    per_block = kv_bytes_per_token(eng.config, torch.float32) * 16
    expected = int((kv_gib or 2.0) * GIB) // per_block
    assert eng.kv_cache_plan.num_blocks == expected == eng.runner.num_blocks
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache sizing")]
    assert len(lines) == 1 and f"fixed, {rule}" in lines[0] and f"= {expected} blocks" in lines[0]
    assert f"{per_block} B per block" in lines[0]

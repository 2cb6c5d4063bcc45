"""Steps of more than Q4_AVX512_MAX_ROWS rows multiply in float32 where oneDNN's bf16 GEMM is the slower one
(engine/model/cpu_linear.py): which CPUs, and that it multiplies by the same bf16 weights."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from engine.kernels import cpu_ops
from engine.model import cpu_linear
from engine.model.cpu_linear import LARGE_STEP_ENV, Q4_AVX512_MAX_ROWS, OneDnnLinear, float32_large_steps


@pytest.mark.parametrize("path, vendor, setting, expected", [
    ("avx512_bf16", "GenuineIntel", "auto", True),  # Intel without AMX: measured faster in float32
    ("avx512_bf16", "AuthenticAMD", "auto", False),  # not measured: unchanged
    ("amx", "GenuineIntel", "auto", False),  # every step through the packed kernels
    ("portable", "GenuineIntel", "auto", False),
    ("amx", "GenuineIntel", "float32", True),
    ("avx512_bf16", "GenuineIntel", "bf16", False),
])
def test_which_cpus_multiply_large_steps_in_float32(path, vendor, setting, expected):
    assert float32_large_steps(path, vendor, setting) is expected


def test_a_bad_setting_names_the_variable():
    with pytest.raises(ValueError, match=LARGE_STEP_ENV):
        float32_large_steps("avx512_bf16", "GenuineIntel", "fp32")


@pytest.mark.skipif(not cpu_linear.can_prepack(torch.bfloat16, "cpu"), reason="no oneDNN bf16 on this CPU")
def test_large_steps_multiply_the_same_bf16_weights_in_float32_and_small_ones_stay_on_onednn():
    torch.manual_seed(0)
    linear = nn.Linear(576, 1536, bias=False).to(torch.bfloat16)
    m = OneDnnLinear(linear)
    small = torch.randn(Q4_AVX512_MAX_ROWS, 576).to(torch.bfloat16)
    large = torch.randn(Q4_AVX512_MAX_ROWS + 1, 576).to(torch.bfloat16)
    onednn_small, onednn_large = m(small), m(large)
    m.float32_from_rows = Q4_AVX512_MAX_ROWS + 1
    assert torch.equal(m(small), onednn_small)
    out = m(large)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, nn.functional.linear(large.float(), linear.weight.float()).to(torch.bfloat16))
    # float32 sums of the same products, rounded once: oneDNN's differ only in the order of the additions
    torch.testing.assert_close(out.float(), onednn_large.float(), rtol=2 ** -7, atol=2e-2)


@pytest.mark.skipif(os.environ.get(cpu_ops.ENV) == "torch", reason="fused CPU kernels turned off")
def test_use_float32_large_steps_follows_the_setting(monkeypatch):
    model = nn.Module()
    model.proj = nn.Linear(8, 8)  # no oneDNN projection: nothing to switch
    monkeypatch.setenv(LARGE_STEP_ENV, "float32")
    assert cpu_linear.use_float32_large_steps(model) is False
    monkeypatch.setenv(LARGE_STEP_ENV, "nonsense")
    with pytest.raises(ValueError, match=LARGE_STEP_ENV):
        cpu_linear.use_float32_large_steps(model)

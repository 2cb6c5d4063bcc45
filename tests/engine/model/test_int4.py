"""The int4 fast path for few-row steps: used only for weights that are exactly 4-bit group-quantized."""

from __future__ import annotations

import pytest
import torch

from engine.model.cpu_linear import INT4_MAX_ROWS, Int4Linear, exact_int4


def _q4_weight(n: int = 64, k: int = 128, seed: int = 0) -> torch.Tensor:
    """What a GGUF Q4_1 tensor dequantizes to: q * d + m per 32 inputs, q in 0..15 (min and max used)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(n, k // 32, 1, generator=g) * 0.05 + 0.001
    m = -(7.0 + torch.rand(n, k // 32, 1, generator=g)) * d  # centred groups, like trained weights
    return (q * d + m).view(n, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_path_reproduces_the_quantized_weight(dtype):
    w = _q4_weight().to(dtype)
    plain = torch.nn.Linear(128, 64, bias=True).to(dtype)
    with torch.no_grad():
        plain.weight.copy_(w)
        plain.bias.copy_(torch.randn(64))
    int4 = exact_int4(plain.weight)
    assert int4 is not None
    lin = Int4Linear(int4, plain)
    x = torch.randn(3, 128).to(dtype)
    want = torch.nn.functional.linear(x.float(), w.float(), lin.bias.float())
    got = lin(x).float()
    tol = 1e-4 if dtype == torch.float32 else 0.05 * want.abs().max().item()
    assert (got - want).abs().max().item() < tol
    big = torch.randn(INT4_MAX_ROWS + 1, 128).to(dtype)  # more rows: the regular path, same result
    assert torch.allclose(lin(big).float(), torch.nn.functional.linear(big, plain.weight, plain.bias).float(),
                          atol=tol, rtol=0)


def test_float_weights_are_not_quantized():
    w = torch.randn(64, 128)
    assert exact_int4(w) is None
    assert exact_int4(w.to(torch.bfloat16)) is None
    assert exact_int4(torch.randn(64, 100)) is None  # inputs not a multiple of the group


def test_a_single_off_grid_value_rejects_the_tensor():
    w = _q4_weight()
    w[5, 40] += 0.4 * (w[5, 32:64].max() - w[5, 32:64].min()) / 15
    assert exact_int4(w) is None

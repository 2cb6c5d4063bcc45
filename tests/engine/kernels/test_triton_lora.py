"""The gathered LoRA kernel (engine/kernels/lora.py) against torch: per row, the slot's B (A x) added to y.

On CPU it runs in Triton's interpreter (loadtest/gpu_check.sh runs it compiled). Rows of several slots and
of the base model (-1) interleaved, ranks padded with zeros in the stacks, y a column slice of a fused output;
then LoRALinear's kernel path (the triton backend's) against its grouped torch path.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.lora.layers import LoRABatch, LoRALinear
from tests.engine.triton_setup import COMPILED, DEVICE, load_kernels, triton_mode  # noqa: F401 (fixture)

K = load_kernels()
pytestmark = pytest.mark.usefixtures("triton_mode")
LK = K["lora"]
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def rand(*shape, seed, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_equals_torch(dtype):
    t, k, n, r, slots = 9, 48, 40, 16, 3
    ranks = [4, 16, 0]  # slot 2 holds nothing (all zeros)
    a = torch.zeros(slots, r, k, dtype=dtype, device=DEVICE)
    b = torch.zeros(slots, n, r, dtype=dtype, device=DEVICE)
    for s, rank in enumerate(ranks):
        a[s, :rank] = rand(rank, k, seed=s, dtype=dtype, scale=k ** -0.5)
        b[s, :, :rank] = rand(n, rank, seed=10 + s, dtype=dtype)
    x = rand(t, k, seed=20, dtype=dtype)
    wide = rand(t, n + 24, seed=21, dtype=dtype)  # y: columns 8..48 of a fused output
    row_slots = torch.tensor([-1, 0, 1, 1, -1, 2, 0, 1, -1], dtype=torch.int32, device=DEVICE)
    want = wide.clone()
    for row, s in enumerate(row_slots.tolist()):
        if s >= 0:
            delta = (b[s].float() @ (a[s].float() @ x[row].float()))
            want[row, 8:8 + n] = (want[row, 8:8 + n].float() + delta).to(dtype)
    got = wide.clone()
    LK.lora_gathered_(got[:, 8:8 + n], x, a, b, row_slots)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)
    assert torch.equal(got[row_slots.cpu() == -1], wide[row_slots.cpu() == -1])  # base rows untouched
    assert torch.equal(got[:, :8], wide[:, :8]) and torch.equal(got[:, 8 + n:], wide[:, 8 + n:])


def test_shapes_are_checked():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="do not fit"):
        LK.lora_gathered_(torch.zeros(2, 4, device=DEVICE), x, torch.zeros(1, 2, 7, device=DEVICE),
                          torch.zeros(1, 4, 2, device=DEVICE), torch.zeros(2, dtype=torch.int32, device=DEVICE))


def test_lora_linear_kernel_path_equals_grouped_torch_path():
    """A fused q|k|v projection, two adapters of ranks 3 and 8 (the second without k), 11 rows mixed with base rows."""
    torch.manual_seed(0)
    sizes, fan_in, max_rank = [16, 8, 8], 12, 8
    base = nn.Linear(fan_in, sum(sizes), bias=False).to(DEVICE)
    parts = {0: [(rand(3, fan_in, seed=1), rand(n, 3, seed=2 + i)) for i, n in enumerate(sizes)],
             1: [(rand(8, fan_in, seed=5), rand(16, 8, seed=6)), None, (rand(8, fan_in, seed=7), rand(8, 8, seed=8))]}
    layers = []
    for kernel in (False, True):
        batch = LoRABatch()
        batch.kernel = kernel
        layer = LoRALinear(base, batch, sizes, fan_in, 2, max_rank, torch.float32, torch.device(DEVICE))
        for slot, p in parts.items():
            layer.set_slot(slot, p)
        batch.set([0, -1, 1, 1, 0, -1, 0, 1, 1, -1, 0], torch.device(DEVICE))
        layers.append(layer)
    x = rand(11, fan_in, seed=9)
    with torch.no_grad():
        torch.testing.assert_close(layers[1](x), layers[0](x), rtol=1e-5, atol=1e-5)

"""One set of weights on every kernel path: the bundled model (GGUF, Q4_1 projections and a Q8_0 head) loaded in
bf16 as the engine loads it, then every projection and the output head multiplied by unit vectors at step sizes
on both sides of every path's row limit. A unit vector's product is one weight, with nothing to sum, so each
path must return exactly the bf16 weight the model holds, whatever kernel serves that step size (the oneDNN
matmul, the packed 4/8-bit kernels, or, under --deterministic, the batch-invariant ones)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu_ops
from engine.model.cpu_layers import use_cpu_kernels
from engine.model.invariant_linear import InvariantHead, InvariantLinear, deterministic_view, invariant_kinds
from engine.model.loader import load_model
from engine.model.registry import resolve_model

pytestmark = pytest.mark.skipif(not cpu_ops.load(), reason="the fused CPU kernels do not build here")

# 1-4: today's few-row paths; 5-256: the 4-bit kernel without AMX; 257+: oneDNN; 24/25: the 8-bit head's limit
ROW_COUNTS = (1, 3, 4, 5, 24, 25, 64, 256, 257, 300)
PROBES = 48  # input columns probed per module (each a unit vector), spread over the whole width


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    loaded, _ = load_model(resolve_model("smollm2"), torch.bfloat16, "cpu", 512)
    use_cpu_kernels(loaded)  # what the engine does for bf16 on the cpu backend
    return loaded


def _units(k: int, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """rows unit vectors of width k (columns spread over 0..k-1, repeated as needed) and their columns."""
    cols = torch.linspace(0, k - 1, PROBES).long()
    cols = cols.repeat(-(-rows // PROBES))[:rows]
    x = torch.zeros(rows, k, dtype=dtype)
    x[torch.arange(rows), cols] = 1
    return x, cols


def _projections(model) -> list[tuple[str, torch.nn.Module]]:
    out = []
    for i in (0, len(model.layers) - 1):
        layer = model.layers[i]
        for name in ("qkv_proj", "o_proj"):
            out.append((f"layers.{i}.self_attn.{name}", getattr(layer.self_attn, name)))
        for name in ("gate_up_proj", "down_proj"):
            out.append((f"layers.{i}.mlp.{name}", getattr(layer.mlp, name)))
    return out


def _check_projections(model) -> list[str]:
    wrong = []
    for name, proj in _projections(model):
        weight = proj.weight.detach()
        for rows in ROW_COUNTS:
            x, cols = _units(weight.shape[1], rows, weight.dtype)
            with torch.no_grad():
                got = proj(x)
            want = weight[:, cols].t()
            if not torch.equal(got.to(weight.dtype), want):
                bad = int((got.to(weight.dtype) != want).sum())
                wrong.append(f"{name} ({type(proj).__name__}) at {rows} rows: {bad} weights differ")
    return wrong


def _check_head(model) -> list[str]:
    weight = model.lm_head_weight.detach()
    wrong = []
    for rows in ROW_COUNTS:
        x, cols = _units(weight.shape[1], rows, weight.dtype)
        with torch.no_grad():
            got = model.output_head(x, weight)
        want = weight[:, cols].t().float()
        if not torch.equal(got, want):
            wrong.append(f"head ({type(model.output_head).__name__}) at {rows} rows: "
                         f"{int((got != want).sum())} weights differ")
    return wrong


def test_every_projection_multiplies_by_the_same_weights_at_every_step_size(model):
    assert _check_projections(model) == []


def test_the_output_head_multiplies_by_the_same_weights_at_every_step_size(model):
    assert _check_head(model) == []


def test_the_deterministic_kernels_multiply_by_the_same_weights(model):
    view = deterministic_view(model)
    use_cpu_kernels(view, deterministic=True)
    assert all(isinstance(p, InvariantLinear) for _, p in _projections(view))
    assert isinstance(view.output_head, InvariantHead)
    # the checkpoint's exact groups: every projection 4-bit, the head 8-bit
    assert invariant_kinds(view) == {"q4": 4 * len(view.layers), "q8": 1}
    assert _check_projections(view) == [] and _check_head(view) == []
    # the view shares the model's tensors and leaves its modules as they were
    assert view.layers[0].mlp.down_proj.weight is model.layers[0].mlp.down_proj.weight
    assert not any(isinstance(m, (InvariantLinear, InvariantHead)) for m in model.modules())

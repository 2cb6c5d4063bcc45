"""The model's layer glue on the Triton kernels, swapped in once: `use_triton_layers(model)`.

When the `triton` attention backend serves a model, the engine calls `use_triton_layers`, which replaces
the residual add + RMSNorm, the rotary embedding + KV write, and SiLU x up of `engine/model/llama.py`
with one Triton kernel each (`engine/kernels/fused_layers.py`): three launches per layer where the torch
modules take about a dozen. The attention and projections are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.cpu_layers import RopeTable
from engine.model.cpu_linear import swap_modules
from engine.model.llama import Attention, LlamaForCausalLM, RMSNorm, SiluAndMul


def _kernels():
    from engine.kernels import fused_layers  # imported late: Triton's interpreter mode is read at import

    return fused_layers


class TritonRMSNorm(nn.Module):
    """RMSNorm's (norm(residual + x), residual + x) in one kernel, in place (x gets the norm)."""

    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps
        self._op = _kernels().add_rms_norm_

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._op(x, residual, self.weight, self.eps)


class TritonAttention(nn.Module):
    """Attention with q/k rotation and the K/V cache write in one kernel, then the backend's attention."""

    def __init__(self, attn: Attention):
        super().__init__()
        self.layer_idx = attn.layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.q_size, self.scale = attn.q_size, attn.scale
        self.qkv_proj, self.o_proj = attn.qkv_proj, attn.o_proj
        self._op = _kernels().rotary_kv_write

    def forward(self, x, rope, kv_cache, meta, backend):
        positions, cos_sin = rope
        k_cache, v_cache = kv_cache
        q = self._op(self.qkv_proj(x), positions, cos_sin, self.num_heads, self.num_kv_heads, k_cache, v_cache,
                     meta.slot_mapping)
        out = backend.forward(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(x.shape[0], self.q_size))


class TritonSiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self._op = _kernels().silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x)


def use_triton_layers(model: LlamaForCausalLM) -> None:
    """Swap the Triton layer kernels into `model`. Idempotent (engines sharing one loaded model call it)."""
    if uses_triton_layers(model):
        return
    swap_modules(model, RMSNorm, lambda _, norm: TritonRMSNorm(norm))
    swap_modules(model, Attention, lambda _, attn: TritonAttention(attn))
    swap_modules(model, SiluAndMul, lambda _, act: TritonSiluAndMul())
    model.rope = RopeTable(model.rope)  # the same (positions, cos|sin) table as the CPU kernels'


def uses_triton_layers(model: nn.Module) -> bool:
    return any(isinstance(m, TritonRMSNorm) for m in model.modules())

"""The model's layer glue on the fused CPU kernels, swapped in once: `use_cpu_kernels(model)`.

When the `cpu` attention backend serves a model, the engine calls `use_cpu_kernels`, which replaces the
residual add + RMSNorm, the rotary embedding and SiLU x up of `engine/model/llama.py` with the modules below
(each one kernel call through `engine.kernels.cpu_ops`) and, where AMX runs them, the projections with
exact 4/8-bit copies with the packed kernels (`cpu_linear.use_quant_kernels`). The kernels compute in
float32 and round once, so reduced-precision results differ from the plain modules in the last bit.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.kernels import cpu_ops
from engine.model.cpu_decode_stack import use_decode_stack
from engine.model.cpu_linear import (
    Q4_AVX512_MAX_ROWS,
    q4_projections,
    q8_head,
    swap_modules,
    use_float32_large_steps,
    use_quant_kernels,
)
from engine.model.invariant_linear import use_invariant_linears
from engine.model.llama import LlamaForCausalLM, QKRotary, RMSNorm, RotaryEmbedding, SiluAndMul

logger = logging.getLogger(__name__)


class FusedRMSNorm(nn.Module):
    """RMSNorm's (norm(residual + x), residual + x), in place: x becomes the norm, residual the sum."""

    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps
        self.weight_f32 = norm.weight.detach().float().contiguous()
        ops = cpu_ops.ops()
        self._rms_norm, self._add_rms_norm_ = ops.rms_norm, ops.add_rms_norm_

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._rms_norm(x, self.weight_f32, self.eps), x
        self._add_rms_norm_(x, residual, self.weight_f32, self.eps)
        return x, residual


class RopeTable(nn.Module):
    """The rotary table for FusedQKRotary: a step's rope is (positions, float32 [max_len, D] cos | sin halves)."""

    def __init__(self, rope: RotaryEmbedding):
        super().__init__()
        half = rope.cos.shape[-1] // 2
        self.register_buffer("cos_sin", torch.cat((rope.cos[:, :half], rope.sin[:, :half]), dim=1).float().contiguous(),
                             persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return positions, self.cos_sin


class FusedQKRotary(nn.Module):
    """QKRotary with q and k rotated in place in the fused qkv rows by one kernel call."""

    def __init__(self, rotary: QKRotary):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = rotary.num_heads, rotary.num_kv_heads, rotary.head_dim
        self._rotary_ = cpu_ops.ops().rotary_

    def forward(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        rotated = self.num_heads + self.num_kv_heads
        self._rotary_(qkv, rope[0], rope[1], rotated, self.head_dim)
        qkv = qkv.view(qkv.shape[0], rotated + self.num_kv_heads, self.head_dim)
        return qkv[:, : self.num_heads], qkv[:, self.num_heads:rotated], qkv[:, rotated:]


class FusedSiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self._silu_and_mul = cpu_ops.ops().silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._silu_and_mul(x)


def use_cpu_kernels(model: LlamaForCausalLM, deterministic: bool = False) -> None:
    """Swap the fused CPU kernels into `model` (bf16 or float32 on CPU), and the packed 4/8-bit projections
    where they run; deterministic: every projection and the head through the batch-invariant kernels instead
    (engine/model/invariant_linear.py; give it a deterministic_view of a model other engines share).
    Idempotent: engines sharing one loaded model (tests, benchmarks) each call it."""
    if deterministic:
        if not uses_cpu_kernels(model):
            _swap_glue(model)
        use_invariant_linears(model)
        model.decode_stack = None  # a view's copy of the shared model's: its projections are not these
        return
    if uses_cpu_kernels(model):
        return
    _swap_glue(model)
    use_quant_kernels(model)
    if q4_projections(model) or q8_head(model):
        logger.info("%d projections%s multiply through the checkpoint's packed 4-bit%s weights (%s kernels, "
                    "the same bf16 values)", q4_projections(model), " and the output head" if q8_head(model)
                    else "", " / 8-bit" if q8_head(model) else "", cpu_ops.ops().quant_path())
    if use_float32_large_steps(model):
        logger.info("steps of more than %d rows multiply in float32 (oneDNN's bf16 GEMM is the slower one on this "
                    "CPU)", Q4_AVX512_MAX_ROWS)
    if use_decode_stack(model):
        logger.info("steps of up to %s decode rows run the decoder layers in one native call", model.decode_stack.max_rows)


def _swap_glue(model: LlamaForCausalLM) -> None:
    """Residual add + RMSNorm, the rotary embedding and SiLU x up: one kernel call each."""
    swap_modules(model, RMSNorm, lambda _, norm: FusedRMSNorm(norm))
    swap_modules(model, QKRotary, lambda _, rotary: FusedQKRotary(rotary))
    swap_modules(model, SiluAndMul, lambda _, act: FusedSiluAndMul())
    model.rope = RopeTable(model.rope)


def uses_cpu_kernels(model: nn.Module) -> bool:
    return any(isinstance(m, FusedRMSNorm) for m in model.modules())

"""Batch-invariant projections and output head for `--deterministic` on CPUs, swapped in once at load.

Under --deterministic every projection and the output head multiply through one kernel for every row count:
a row's result is computed from that row alone, in one fixed order, so it does not depend on what else shares
the step (engine/kernels/quant_gemm.cpp, f32_gemm.cpp). The default paths pick a kernel by the step's row count
(torch's oneDNN for large steps, the packed 4/8-bit kernels for small ones), and each sums in its own order.

- bf16 with the checkpoint's exact 4-bit groups (GGUF Q4_1): `q4_linear`, the same bf16 weight values;
- other bf16 weights: `bf16_linear`, the same kernel over the weights repacked in tile order;
- float32 weights: `f32_linear`;
- the head: `q8_linear` over the checkpoint's exact 8-bit groups (GGUF Q8_0), else as the projections,
  float32 logits straight from the float32 sums.

`deterministic_view(model)` is a copy of the model's modules that shares every weight tensor, so an engine
under --deterministic can swap its layers without touching another engine that serves the same loaded model.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu_ops
from engine.model.cpu_linear import OneDnnHead, OneDnnLinear, Q4Linear, Q8Head, swap_modules
from engine.model.llama import LlamaForCausalLM, OutputHead

COLS, GROUP = 16, 32  # the kernels' column block and (bf16) input group


def pack_tiles_bf16(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] (N a multiple of 16, K of 32) in bf16_linear's tile order: [N/16, K/32, 16, 32], where
    element e of row r of a chunk is column e // 2, input 2r + e % 2."""
    n, k = weight.shape
    tiles = weight.detach().to(torch.bfloat16).reshape(n // COLS, COLS, k // GROUP, GROUP // 2, 2)
    return tiles.permute(0, 2, 3, 1, 4).reshape(n // COLS, k // GROUP, GROUP // 2, 2 * COLS).contiguous()


def pack_columns_f32(weight: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] (N a multiple of 16) in f32_linear's order: [N/16, K, 16]."""
    n, k = weight.shape
    return weight.detach().float().reshape(n // COLS, COLS, k).transpose(1, 2).contiguous()


def _padded(weight: torch.Tensor, k_multiple: int) -> torch.Tensor:
    """The weight with zero rows up to a multiple of 16 outputs and zero columns up to k_multiple inputs."""
    n, k = weight.shape
    pad_n, pad_k = -n % COLS, -k % k_multiple
    return F.pad(weight.detach(), (0, pad_k, 0, pad_n)) if pad_n or pad_k else weight.detach()


class InvariantMatmul:
    """x [M, K] @ weight^T (+ bias) through one batch-invariant kernel, whatever M is."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, q_packed: tuple | None = None,
                 q8: bool = False):
        ops = cpu_ops.ops()
        self.n, self.k = weight.shape
        self.dtype = weight.dtype
        if weight.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"--deterministic runs bfloat16 and float32 models on CPUs, not {weight.dtype}")
        if q_packed is not None and weight.dtype == torch.bfloat16:
            self.kind, self.packed = ("q8" if q8 else "q4"), q_packed
            self._op = ops.q8_linear if q8 else ops.q4_linear
            self.k_pad = self.k
        elif weight.dtype == torch.bfloat16:
            self.kind, self.packed = "bf16", pack_tiles_bf16(_padded(weight, GROUP))
            self._op = ops.bf16_linear
            self.k_pad = self.packed.shape[1] * GROUP
        else:
            self.kind, self.packed = "f32", pack_columns_f32(_padded(weight, 1))
            self._op = ops.f32_linear
            self.k_pad = self.k
        n_pad = -self.n % COLS
        self.bias = None if bias is None else F.pad(bias.detach(), (0, n_pad)).to(weight.dtype).contiguous()

    def __call__(self, x: torch.Tensor, float_out: bool = False) -> torch.Tensor:
        if x.shape[-1] != self.k_pad:
            x = F.pad(x, (0, self.k_pad - x.shape[-1]))
        if self.kind == "f32":
            out = self._op(x, self.packed, self.bias)
        elif self.kind == "bf16":
            out = self._op(x, self.packed, self.bias, True, float_out)
        else:
            out = self._op(x, self.packed[0], self.packed[1], self.bias, True, float_out)
        return out if out.shape[-1] == self.n else out[:, :self.n]


class InvariantLinear(nn.Module):
    """A projection through InvariantMatmul; weight and bias stay readable (code inspects them)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, q4_packed: tuple | None = None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.matmul = InvariantMatmul(weight, bias, q4_packed)

    @property
    def kind(self) -> str:
        return self.matmul.kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)


class InvariantHead(nn.Module):
    """Float32 logits through InvariantMatmul (the checkpoint's exact 8-bit head where it has one)."""

    def __init__(self, weight: torch.Tensor, q8_packed: tuple | None = None):
        super().__init__()
        self.matmul = InvariantMatmul(weight, None, q8_packed, q8=True)

    @property
    def kind(self) -> str:
        return self.matmul.kind

    def forward(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = self.matmul(h, float_out=True)
        return out if out.dtype == torch.float32 else out.float()


def _projection(linear: nn.Module) -> InvariantLinear:
    q4 = getattr(linear, "q4_packed", None)
    return InvariantLinear(linear.weight, linear.bias, q4)


def use_invariant_linears(model: LlamaForCausalLM) -> None:
    """Every projection of the decoder layers and the output head through the batch-invariant kernels."""
    for cls in (Q4Linear, OneDnnLinear, nn.Linear):  # Q4Linear holds a OneDnnLinear: the outer one first
        swap_modules(model.layers, cls, lambda _, linear: _projection(linear))
    head = model.output_head
    if isinstance(head, InvariantHead):
        return
    q8 = head.q8_packed if isinstance(head, (Q8Head, OneDnnHead)) else None
    if not isinstance(head, (OutputHead, OneDnnHead, Q8Head)):
        raise ValueError(f"--deterministic cannot serve an output head of type {type(head).__name__}")
    model.output_head = InvariantHead(model.lm_head_weight, q8)


def deterministic_view(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """A copy of the model's module tree that shares every parameter, buffer and other tensor with it."""

    def clone(module: nn.Module) -> nn.Module:
        copied = copy.copy(module)  # the same attributes (tensors, packed weights, kernel handles)
        copied._parameters = dict(module._parameters)
        copied._buffers = dict(module._buffers)
        copied._modules = {name: None if child is None else clone(child) for name, child in module._modules.items()}
        return copied

    return clone(model)


def invariant_kinds(model: nn.Module) -> dict[str, int]:
    """How many projections (and heads) multiply through each kernel: {"q4": 210, "q8": 1, ...}."""
    kinds: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, (InvariantLinear, InvariantHead)):
            kinds[m.kind] = kinds.get(m.kind, 0) + 1
    return kinds

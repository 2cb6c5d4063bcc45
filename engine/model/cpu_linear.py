"""Faster projections for bf16 models on CPUs, swapped into the model once at load.

`prepack` (the loader calls it for bf16 on CPU) replaces every nn.Linear projection of the decoder layers
with `OneDnnLinear` (the weight pre-packed for oneDNN: no repacking per call) and the output head with
`OneDnnHead`. Every path multiplies by exactly the model's bf16 weights (torch's int4 kernel, whose bf16
scales round some weights differently, is not used: tests/engine/model/test_one_set_of_weights.py). `QuantCapture` watches `load_weights` for exact 4/8-bit
groups in the float32 checkpoint values and keeps their packed copies on the modules; once the fused
kernels are in use, `use_quant_kernels` swaps in `Q4Linear` (on AMX, or AVX-512 BF16 for steps of up to
Q4_AVX512_MAX_ROWS rows) and `Q8Head` (on AMX, or AVX-512 BF16 for steps of up to Q8_AVX512_HEAD_MAX_ROWS
rows), which multiply through them (engine/kernels/quant_gemm.cpp: a
third of the bytes, exactly the bf16 weights). `use_float32_large_steps` multiplies steps of more than
Q4_AVX512_MAX_ROWS rows in float32 where oneDNN's bf16 GEMM is the slower one (Intel without AMX).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn

from engine.kernels import cpu_ops
from engine.model.llama import LlamaForCausalLM, ModelConfig
from engine.model.quantized import find_q4, find_q8, pack_q4, pack_q8

QUANT_ENV = "KVFLEET_QUANT_KERNELS"  # "off": keep the bf16 (oneDNN) matmuls even where the packed 4/8-bit kernels run
Q8_HEAD_MAX_ROWS = 24  # the 8-bit head: 1.5x oneDNN at 1-16 rows, 1.06x at 24, parity at 32, 0.85x at 48 (AMX-bound)
# AVX-512 BF16 (no AMX), one step's projections of SmolLM2 alone (loadtest.cpu_kernels_bench projections):
# 1.5-1.7x oneDNN bf16 at 1-8 rows, 1.14-1.21x at 16-64, 1.05x at 128, parity at 192-256, 0.94-0.96x at 512.
# Inside whole engine steps (loadtest.mixed_step: 64 decodes and a prompt, the two paths alternating step by
# step in one engine) q4 wins more, its weights a third of the bytes beside the KV reads: 1.07-1.10x at 129 rows,
# 1.07-1.08x at 194, 0.99-1.02x at 264, 0.97x at 364. The 8-bit head is 0.8-0.9x oneDNN at every row count there,
# so larger steps stay on oneDNN; steps of up to 8 rows run the kernel's fused path (each chunk row dequantized in
# registers), on cold weights (AMD EPYC Zen 4, 2 threads, 49152 x 576): 1.7-2.0x oneDNN at 1-2 rows, 1.25x at 4,
# 1.17x at 8, 1.03x at 16.
Q8_AVX512_HEAD_MAX_ROWS = 8
Q4_AVX512_MAX_ROWS = 256
LARGE_STEP_ENV = "KVFLEET_LARGE_STEP_GEMM"  # "auto", "bf16" (oneDNN) or "float32": how steps of more rows multiply
# Intel Xeon with AVX-512 BF16 and no AMX, one thread, 512 x 576 x 1536: oneDNN's bf16 brgemm ~100 GFLOP/s, MKL's
# float32 ~190 (its VDPBF16PS issues on one port, float32 FMAs on two); whole prompts 1.3-1.4x faster in float32,
# the bf16 weights cast per call (as fast as a kept float32 copy, and no memory for one). AMD's Zen 4/5 not measured.

Packed = tuple[torch.Tensor, torch.Tensor]


def can_prepack(dtype: torch.dtype, device: torch.device | str) -> bool:
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _onednn_pack(weight: torch.Tensor, batch_hint: int = 64) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


class QuantCapture:
    """Observer for LlamaForCausalLM.load_weights: the exact 4-bit groups of each projection (per fused part)
    and the exact 8-bit groups of the output weights, found in the float32 checkpoint values."""

    def __init__(self, config: ModelConfig):
        self.head_name = "embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        self.q4_parts: dict[str, dict[int, tuple | None]] = {}
        self.q8_head: Packed | None = None

    def __call__(self, name: str, start: int, tensor: torch.Tensor) -> None:
        if name.endswith("_proj.weight"):
            self.q4_parts.setdefault(name, {})[start] = find_q4(tensor)
        if name == self.head_name:
            self.q8_head = find_q8(tensor)

    def q4_packed(self, name: str, shape: torch.Size) -> Packed | None:
        """The packed 4-bit form of a (possibly fused) projection whose every part was recovered, else None."""
        parts = self.q4_parts.get(name)
        if not parts or any(p is None for p in parts.values()):
            return None
        ordered = [parts[start] for start in sorted(parts)]
        q, s, m = (torch.cat([p[i] for p in ordered]) for i in range(3))
        return pack_q4(q, s, m) if tuple(q.shape) == tuple(shape) else None


class OneDnnLinear(nn.Module):
    """A projection through its oneDNN pre-packed weight; q4_packed: its exact 4-bit copy, if any."""

    def __init__(self, linear: nn.Module, q4_packed: Packed | None = None):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = _onednn_pack(linear.weight)
        self.q4_packed = q4_packed
        self.float32_from_rows: int | None = None  # steps of at least this many rows multiply in float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float32_from_rows is not None and x.shape[0] >= self.float32_from_rows:
            bias = None if self.bias is None else self.bias.float()
            return nn.functional.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class Q4Linear(nn.Module):
    """A projection through its packed 4-bit weight (q4_linear: the same bf16 values); steps of more than
    max_rows rows (None: no limit) through `large`, its oneDNN projection."""

    def __init__(self, large: OneDnnLinear, q4_packed: Packed, max_rows: int | None = None):
        super().__init__()
        self.weight, self.bias = large.weight, large.bias
        self.q4_packed, self.large, self.max_rows = q4_packed, large, max_rows
        self._q4_linear = cpu_ops.ops().q4_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.max_rows is not None and x.shape[0] > self.max_rows:
            return self.large(x)
        return self._q4_linear(x, self.q4_packed[0], self.q4_packed[1], self.bias)


class OneDnnHead(nn.Module):
    """Float32 logits through the oneDNN pre-packed output weights; q8_packed: their exact 8-bit copy, if any."""

    def __init__(self, weight: torch.Tensor, q8_packed: Packed | None = None):
        super().__init__()
        self.packed = _onednn_pack(weight)
        self.q8_packed = q8_packed

    def forward(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(h, self.packed, None, "none", [], "").float()


class Q8Head(nn.Module):
    """Steps of up to `max_rows` rows through the packed 8-bit output weights, float32 logits straight from the
    float32 sums (bf16 logits, spacing 0.125 at 16-32, tie close tokens); larger ones through `large`."""

    def __init__(self, q8_packed: Packed, large: nn.Module, max_rows: int = Q8_HEAD_MAX_ROWS):
        super().__init__()
        self.q8_packed, self.large, self.max_rows = q8_packed, large, max_rows
        self._q8_linear = cpu_ops.ops().q8_linear

    def forward(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if h.shape[0] > self.max_rows:
            return self.large(h, weight)
        return self._q8_linear(h, self.q8_packed[0], self.q8_packed[1], None, True, True)


def swap_modules(model: nn.Module, cls: type[nn.Module], make: Callable[[str, nn.Module], nn.Module]) -> None:
    """Replace every submodule of exactly type `cls` with make(its qualified name, it)."""
    for name, module in list(model.named_modules()):
        if type(module) is cls and name:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, make(name, module))


def prepack(model: LlamaForCausalLM, capture: QuantCapture) -> None:
    """The oneDNN projections and output head; the exact 4/8-bit copies that `capture` found are kept for
    use_quant_kernels (and for the batch-invariant kernels of --deterministic)."""

    def packed(name: str, linear: nn.Module) -> nn.Module:
        return OneDnnLinear(linear, capture.q4_packed(f"{name}.weight", linear.weight.shape))

    swap_modules(model.layers, nn.Linear, lambda name, linear: packed(f"layers.{name}", linear))
    head = model.lm_head_weight
    q8 = capture.q8_head
    model.output_head = OneDnnHead(head, pack_q8(*q8) if q8 is not None and q8[0].shape == head.shape else None)


def use_quant_kernels(model: LlamaForCausalLM) -> None:
    """Where the CPU runs the packed kernels fast (and KVFLEET_QUANT_KERNELS is not "off"), projections with
    exact 4-bit copies multiply through them: every step on AMX, steps of up to Q4_AVX512_MAX_ROWS rows with
    AVX-512 BF16; the head with an exact 8-bit copy too (every step up to Q8_HEAD_MAX_ROWS rows on AMX, up to
    Q8_AVX512_HEAD_MAX_ROWS with AVX-512 BF16)."""
    path = cpu_ops.ops().quant_path()
    if path == "portable" or os.environ.get(QUANT_ENV, "auto") == "off":
        return
    max_rows = None if path == "amx" else Q4_AVX512_MAX_ROWS
    swap_modules(model, OneDnnLinear,
                 lambda _, linear: linear if linear.q4_packed is None else Q4Linear(linear, linear.q4_packed, max_rows))
    head = model.output_head
    if isinstance(head, OneDnnHead) and head.q8_packed is not None:
        model.output_head = Q8Head(head.q8_packed, head, Q8_HEAD_MAX_ROWS if path == "amx" else Q8_AVX512_HEAD_MAX_ROWS)


def float32_large_steps(path: str, vendor: str, setting: str = "auto") -> bool:
    """Whether steps of more than Q4_AVX512_MAX_ROWS rows multiply in float32 rather than oneDNN bf16: `setting`
    (LARGE_STEP_ENV) "float32" or "bf16" says; "auto" chooses float32 on Intel CPUs with AVX-512 BF16 and no AMX
    (`path` "avx512_bf16", `vendor` "GenuineIntel"), where it is measured faster; elsewhere bf16 (AMX runs every
    step through the packed kernels, AMD's AVX-512 BF16 is not measured, CPUs without it load float32 models)."""
    if setting not in ("auto", "bf16", "float32"):
        raise ValueError(f"{LARGE_STEP_ENV} must be 'auto', 'bf16' or 'float32', got {setting!r}")
    if setting != "auto":
        return setting == "float32"
    return path == "avx512_bf16" and vendor == "GenuineIntel"


def use_float32_large_steps(model: nn.Module) -> bool:
    """Where `float32_large_steps` says so, every oneDNN projection of `model` (those the packed kernels hand
    their larger steps to) multiplies steps of more than Q4_AVX512_MAX_ROWS rows in float32: the same bf16
    weights and inputs, float32 sums, rounded to bf16 once, as oneDNN's. Returns whether it did."""
    vendor = next((line.split(b":", 1)[1].strip().decode() for line in cpu_ops.cpu_identity().splitlines()
                   if line.startswith(b"vendor_id")), "")
    if not float32_large_steps(cpu_ops.ops().quant_path(), vendor, os.environ.get(LARGE_STEP_ENV, "auto")):
        return False
    linears = [m for m in model.modules() if isinstance(m, OneDnnLinear)]
    for m in linears:
        m.float32_from_rows = Q4_AVX512_MAX_ROWS + 1
    return bool(linears)


def q4_projections(model: nn.Module) -> int:
    """How many projections multiply through their packed 4-bit weights."""
    return sum(1 for m in model.modules() if isinstance(m, Q4Linear))


def q8_head(model: LlamaForCausalLM) -> bool:
    """Whether the logits come from the checkpoint's packed 8-bit output weights."""
    return isinstance(model.output_head, Q8Head)

"""Small host-side helpers shared by the attention kernels."""

from __future__ import annotations

import torch


def f32_dot(q: torch.Tensor) -> bool:
    """Whether the kernels take their dot products in float32 (IEEE) rather than on the input dtype.

    Always for float32 inputs (no TF32: the backend must match the reference to 1e-5). Also for
    bfloat16 under Triton's interpreter (CPU tensors), whose tl.dot multiplies bf16 operands as their
    raw uint16 bits; the operands are upcast exactly, so only the summation order differs from the GPU.
    """
    return f32_dot_for(q.dtype, q.device.type)


def f32_dot_for(dtype: torch.dtype, device_type: str) -> bool:
    """f32_dot for tensors of this dtype on this device type (engine/kernels/variants.py asks for "cuda")."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and device_type != "cuda")

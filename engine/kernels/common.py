"""Small host-side helpers shared by the attention kernels."""

from __future__ import annotations

import torch


def f32_dot(q: torch.Tensor) -> bool:
    """Whether the kernels take their dot products in float32 (IEEE) rather than on the input dtype.

    Always for float32 inputs (no TF32: the backend must match the reference to 1e-5). Also for
    bfloat16 under Triton's interpreter (CPU tensors), whose tl.dot multiplies bf16 operands as their
    raw uint16 bits; the operands are upcast exactly, so only the summation order differs from the GPU.
    """
    return q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and q.device.type != "cuda")

"""Attention backends: `torch` (any device, and the reference), `cpu` (fused C++ kernels for CPUs) and
`triton` (CUDA kernels).

`get_attention_backend("auto", device, dtype)` picks triton on CUDA; on CPUs it picks cpu for bfloat16
when the fused kernels build here (`engine/kernels/cpu_ops.py`) and torch otherwise (float32 stays on the
torch path, whose arithmetic matches Hugging Face's op for op).
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata

BACKEND_NAMES = ("auto", "torch", "cpu", "triton")

logger = logging.getLogger(__name__)

__all__ = ["AttentionBackend", "AttentionMetadata", "BACKEND_NAMES", "get_attention_backend"]


def get_attention_backend(name: str = "auto", device: torch.device | str | None = None,
                          dtype: torch.dtype | None = None, deterministic: bool = False) -> AttentionBackend:
    """The backend `name` for tensors of `dtype` on `device` (default: CPU).

    "triton" on a non-CUDA device is only allowed under the Triton interpreter (TRITON_INTERPRET=1),
    which is how the kernels are tested on CPUs. deterministic (--deterministic): the cpu backend's
    batch-invariant mode, on CPUs only ("auto" picks it for float32 too).
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention backend {name!r} is unknown; choose one of {', '.join(BACKEND_NAMES)}")
    dev = torch.device(device if device is not None else "cpu")
    if deterministic:
        return _deterministic_backend(name, dev)
    if name == "auto":
        name = "triton" if dev.type == "cuda" else ("cpu" if use_cpu_kernels(dev, dtype) else "torch")
        if name == "triton" and importlib.util.find_spec("triton") is None:
            logger.warning("triton is not installed: attention falls back to the torch backend on %s", dev)
            name = "torch"
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "cpu":
        if dev.type != "cpu":
            raise ValueError(f"attention backend 'cpu' runs on CPUs, not on {dev}")
        from engine.kernels import cpu_ops

        if not cpu_ops.load():
            raise ValueError(f"attention backend 'cpu' is unavailable: {cpu_ops.unavailable_reason()}")
        from engine.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"attention backend 'triton' needs a CUDA device (got {dev}); on CPUs use 'torch' "
                         "(or set TRITON_INTERPRET=1 to run the kernels in Triton's interpreter)")
    from engine.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


def use_cpu_kernels(device: torch.device | str, dtype: torch.dtype | None) -> bool:
    """Whether the fused CPU kernels serve this device and dtype by default: bfloat16 on a CPU, built here."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return False
    from engine.kernels import cpu_ops

    return cpu_ops.load()


def _deterministic_backend(name: str, dev: torch.device) -> AttentionBackend:
    if dev.type != "cpu":
        raise ValueError(f"--deterministic runs on CPUs for now (batch-invariant CPU kernels); not on {dev}")
    if name not in ("auto", "cpu"):
        raise ValueError(f"--deterministic needs the cpu attention backend (its batch-invariant kernels), "
                         f"not {name!r}")
    from engine.kernels import cpu_ops

    if not cpu_ops.load():
        raise ValueError(f"--deterministic needs the fused CPU kernels, which are unavailable: "
                         f"{cpu_ops.unavailable_reason()}")
    from engine.attention.cpu_backend import CpuAttentionBackend

    return CpuAttentionBackend(deterministic=True)

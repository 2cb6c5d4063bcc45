"""Attention backends: `torch` (CPU, and the reference) and `triton` (CUDA kernels).

`get_attention_backend("auto", device)` picks triton on CUDA and torch otherwise.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata

BACKEND_NAMES = ("auto", "torch", "triton")

logger = logging.getLogger(__name__)

__all__ = ["AttentionBackend", "AttentionMetadata", "BACKEND_NAMES", "get_attention_backend"]


def get_attention_backend(name: str = "auto", device: torch.device | str | None = None) -> AttentionBackend:
    """The backend `name` for tensors on `device` (default: CPU).

    "triton" on a non-CUDA device is only allowed under the Triton interpreter (TRITON_INTERPRET=1),
    which is how the kernels are tested on CPUs.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention backend {name!r} is unknown; choose one of {', '.join(BACKEND_NAMES)}")
    dev = torch.device(device if device is not None else "cpu")
    if name == "auto":
        name = "triton" if dev.type == "cuda" else "torch"
        if name == "triton" and importlib.util.find_spec("triton") is None:
            logger.warning("triton is not installed: attention falls back to the torch backend on %s", dev)
            name = "torch"
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"attention backend 'triton' needs a CUDA device (got {dev}); on CPUs use 'torch' "
                         "(or set TRITON_INTERPRET=1 to run the kernels in Triton's interpreter)")
    from engine.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()

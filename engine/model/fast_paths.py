"""Which fused kernels a loaded model runs on, chosen once from the attention backend, dtype and determinism:
the engine's model and a draft model (engine/spec/draft_model.py) go through the same choice."""

from __future__ import annotations

import torch

from engine.model.cpu_layers import use_cpu_kernels
from engine.model.invariant_linear import deterministic_view
from engine.model.llama import LlamaForCausalLM
from engine.model.triton_layers import use_triton_layers


def use_fast_paths(model: LlamaForCausalLM, backend_name: str, dtype: torch.dtype,
                   deterministic: bool) -> LlamaForCausalLM:
    """The model to run: under --deterministic a view of it on the batch-invariant kernels (another engine may
    serve the same loaded model); else the same model with the CPU kernels (bf16 / float32 on the cpu backend:
    the layers' glue runs through them too) or the Triton layers (residual+norm, rotary+KV write, SiLU x up)."""
    if deterministic:
        model = deterministic_view(model)
        use_cpu_kernels(model, deterministic=True)
    elif backend_name == "cpu" and dtype in (torch.bfloat16, torch.float32):
        use_cpu_kernels(model)
    elif backend_name == "triton":
        use_triton_layers(model)
    return model

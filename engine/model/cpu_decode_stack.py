"""A step's decoder layers in one native call on CPUs (engine/kernels/decode_stack.cpp), built at load.

A single stream's decode step on a 2-core Xeon spent ~5.5 of its ~15 ms between the kernels: ~300 calls
from Python (nn.Module, argument parsing, the dispatcher's Python binding), ten per layer. `use_decode_stack(model)`
(use_cpu_kernels calls it last) collects every layer's weights as the fused kernels left them into one
`kvfleet_cpu.DecodeStack`; `LlamaForCausalLM.forward` offers it each step, and it runs all the layers in a C++
loop when the step is one it serves, else returns None and the Python layers run:
- the `cpu` attention backend would attend every row of the step as a decode row of its paged kernel
  (`CpuAttentionBackend.decode_plan`): decodes, speculative verification, short prompts and extends; not longer
  prompts (its prefill kernel or SDPA), nor any step under --deterministic;
- no row under a LoRA adapter (an idle LoRA wrapper calls the projection it wraps, as here);
- every projection takes the path it was built with at this many rows (a packed 4-bit projection hands steps
  of more than its max_rows to oneDNN; oneDNN's hands steps from float32_from_rows rows to float32).
The loop calls the same ops with the same arguments in the same order as the layers: the same bits
(tests/engine/model/test_decode_stack.py).
"""

from __future__ import annotations

import math
import os

import torch

from engine.attention.cpu_backend import CpuAttentionBackend
from engine.kernels import cpu_ops
from engine.model.cpu_linear import OneDnnLinear, Q4Linear
from engine.model.llama import Attention, LlamaForCausalLM

STACK_ENV = "KVFLEET_DECODE_STACK"  # "auto" (default) or "off": the Python layers run every step (to compare)
PROJECTIONS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))
_NO_BIAS = torch.empty(0)


class CpuDecodeStack:
    """The model's layers for steps of up to max_rows rows, each a decode row; see the module docstring."""

    def __init__(self, model: LlamaForCausalLM, projections: list, max_rows: int | float):
        cfg = model.config
        tensors, kinds, norms = [], [], []
        for i, layer in enumerate(model.layers):
            norms += [layer.input_layernorm.weight_f32, layer.post_attention_layernorm.weight_f32]
            for proj in projections[4 * i:4 * i + 4]:
                bias = _NO_BIAS if proj.bias is None else proj.bias.detach()
                if isinstance(proj, Q4Linear):
                    kinds.append(0)
                    tensors += [proj.q4_packed[0], proj.q4_packed[1], bias]
                else:
                    kinds.append(1)
                    tensors += [proj.packed, _NO_BIAS, bias]
        self.num_heads, self.max_rows = cfg.num_heads, max_rows
        self.first = projections[0]  # layer 0's qkv projection (or what its LoRA wrapper wraps) while these weights serve
        eps, scale = model.layers[0].input_layernorm.eps, model.layers[0].self_attn.scale
        self._stack = cpu_ops.decode_stack_class()(norms, tensors, kinds, cfg.num_heads, cfg.num_kv_heads,
                                                   cfg.head_dim, eps, scale)
        self._model = model
        self._caches: tuple[list, list[torch.Tensor], list[torch.Tensor]] | None = None

    def __call__(self, h: torch.Tensor, rope, kv_caches, meta, backend) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(h, residual) after every layer, or None where this step is not one the stack serves."""
        n = h.shape[0]
        if n > self.max_rows or type(backend) is not CpuAttentionBackend or not self._projections_unchanged():
            return None
        k0, v0 = kv_caches[0]
        plan = backend.decode_plan(meta, k0, v0, n, self.num_heads, h.dtype)
        if plan is None:
            return None
        tables, lens, split = plan
        ks, vs = self._split(kv_caches)
        h, residual = self._stack.run(h, rope[0], rope[1], ks, vs, meta.slot_mapping.to(torch.long), tables, lens, split)
        return h, residual

    def _projections_unchanged(self) -> bool:
        """Layer 0's qkv projection is the one the stack was built from, or a LoRA wrapper of it (engine/lora/layers.py:
        `base`, the projection it wraps; `batch.active`, some row of this step runs under an adapter) with no adapter
        row in this step (engine.model does not import engine.lora, which builds on it)."""
        qkv = self._model.layers[0].self_attn.qkv_proj
        if qkv is self.first:
            return True
        return getattr(qkv, "base", None) is self.first and not qkv.batch.active

    def _split(self, kv_caches) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The K and the V caches as two lists, kept while the same cache list comes back (each runner keeps its own)."""
        if self._caches is None or self._caches[0] is not kv_caches:
            self._caches = (kv_caches, [k for k, _ in kv_caches], [v for _, v in kv_caches])
        return self._caches[1], self._caches[2]


def use_decode_stack(model: LlamaForCausalLM) -> bool:
    """Build the stack where every layer is as use_cpu_kernels leaves it (fused glue, oneDNN or packed 4-bit
    projections, the plain attention module); returns whether it did. The kernels must be loaded."""
    from engine.model.cpu_layers import FusedQKRotary, FusedRMSNorm, FusedSiluAndMul, RopeTable

    model.decode_stack = None
    setting = os.environ.get(STACK_ENV, "auto")
    if setting not in ("auto", "off"):
        raise ValueError(f"{STACK_ENV} must be 'auto' or 'off', got {setting!r}")
    if setting == "off" or not isinstance(model.rope, RopeTable):
        return False
    projections, max_rows = [], math.inf
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not (type(attn) is Attention and isinstance(attn.rotary, FusedQKRotary) and isinstance(mlp.act, FusedSiluAndMul)
                and isinstance(layer.input_layernorm, FusedRMSNorm)
                and isinstance(layer.post_attention_layernorm, FusedRMSNorm)):
            return False
        for owner, name in PROJECTIONS:
            proj = getattr(getattr(layer, owner), name)
            if type(proj) is Q4Linear:
                max_rows = min(max_rows, proj.max_rows if proj.max_rows is not None else math.inf)
            elif type(proj) is OneDnnLinear:
                max_rows = min(max_rows, (proj.float32_from_rows or math.inf) - 1)
            else:
                return False
            projections.append(proj)
    model.decode_stack = CpuDecodeStack(model, projections, max_rows)
    return True

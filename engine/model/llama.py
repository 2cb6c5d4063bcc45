"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over a flattened, paged batch.

One forward pass takes the new tokens of every scheduled sequence flattened into one row each
(prefill chunks and decode tokens mixed), writes their K/V into the paged cache through the attention
backend and reads each sequence's context back from it. Logits are computed only for the rows the
engine samples from (`logits_indices`). Q/K/V and gate/up projections are fused into one matmul each.
The arithmetic follows Hugging Face's implementation op for op, so float32 outputs match it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.metadata import AttentionMetadata
from engine.model.quantized import find_q4, find_q8, pack_q4, pack_q8

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


class UnsupportedModelError(ValueError):
    """The model's configuration asks for something this decoder does not implement."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    rope_theta: float = 10000.0
    rope_parameters: dict = field(default_factory=dict, compare=False, hash=False)
    model_type: str = "llama"
    sliding_window: int | None = None  # attention window of Mistral-style models (full attention within it)

    @classmethod
    def from_hf(cls, hf) -> ModelConfig:
        model_type = getattr(hf, "model_type", "llama")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_ARCHITECTURES}")
        act = getattr(hf, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported; expected 'silu'")
        heads = hf.num_attention_heads
        rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        return cls(
            vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers, num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            rms_norm_eps=hf.rms_norm_eps, max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=bool(getattr(hf, "attention_bias", False)) or model_type == "qwen2",
            o_bias=bool(getattr(hf, "attention_bias", False)) and model_type != "qwen2",
            mlp_bias=bool(getattr(hf, "mlp_bias", False)), rope_theta=float(theta),
            rope_parameters=rope, model_type=model_type,
            sliding_window=(getattr(hf, "sliding_window", None) if getattr(hf, "use_sliding_window", True) else None))


def rope_inv_freq(config: ModelConfig, hf_config=None, max_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling, computed exactly like transformers does."""
    rope_type = config.rope_parameters.get("rope_type", config.rope_parameters.get("type", "default"))
    if rope_type == "default" or hf_config is None:
        dim = config.head_dim
        inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported; expected one of "
                                    f"{['default', *ROPE_INIT_FUNCTIONS]}")
    if rope_type == "dynamic":  # NTK scaling fixed for the longest context we serve
        return ROPE_INIT_FUNCTIONS[rope_type](hf_config, None, max_len)
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_len, looked up per token."""

    def __init__(self, config: ModelConfig, max_len: int, hf_config=None):
        super().__init__()
        inv_freq, scaling = rope_inv_freq(config, hf_config, max_len)
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] for the tokens at positions [T], once per forward pass."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (HF's rotate_half convention, same op order)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.weight_f32: torch.Tensor | None = None  # float32 copy for the fused CPU kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32: bit-identical to HF's op sequence; reduced precision: one fused op (accumulates in float32)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Linear(nn.Linear):
    """nn.Linear with optional CPU fast paths: a weight pre-packed for oneDNN (bf16: no repacking per call)
    and, for weights that are exactly 4-bit group-quantized (GGUF Q4_1 checkpoints), two 4-bit copies:
    torch's int4 kernel serves steps of up to INT4_MAX_ROWS rows (the fastest there; its bf16 scales round
    the weights slightly differently), and on CPUs with AMX every larger step multiplies through the packed
    copy (engine/kernels/quant_gemm.cpp: a third of the bytes, exactly the bf16 weights)."""

    packed: torch.Tensor | None = None
    q4_packed: tuple[torch.Tensor, torch.Tensor] | None = None  # (qweight, scales) of quantized.pack_q4
    q4: tuple[torch.Tensor, torch.Tensor] | None = None  # q4_packed, once the AMX kernel is known to run
    int4: tuple[torch.Tensor, torch.Tensor] | None = None  # (packed 4-bit weight, [K/32, N, 2] scales/zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int4 is not None and x.shape[0] <= INT4_MAX_ROWS:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.int4[0], INT4_GROUP, self.int4[1])
            return out if self.bias is None else out + self.bias
        if self.q4 is not None:
            return torch.ops.kvfleet_cpu.q4_linear(x, self.q4[0], self.q4[1], self.bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


QUANT_ENV = "KVFLEET_QUANT_KERNELS"  # "off": keep the bf16 (oneDNN) matmuls even where the packed 4/8-bit kernels run
Q8_HEAD_MAX_ROWS = 24  # the 8-bit head: 1.5x oneDNN at 1-16 rows, 1.06x at 24, parity at 32, 0.85x at 48 (AMX-bound)
INT4_GROUP = 32
INT4_MAX_ROWS = 4  # steps of up to this many rows: 1.6-1.9x oneDNN bf16 at 1 row, 1.4x q4_linear at 1-2, ~1.1x at 4


def can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def prepack(weight: torch.Tensor, batch_hint: int = 64) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


def exact_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The weight as 4-bit values with a scale and zero per 32 inputs, if that reproduces it (up to the
    rounding of the model dtype): true for checkpoints that were 4-bit quantized, false for float ones."""
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return None
    w = weight.detach().float()
    n, k = w.shape
    if k % INT4_GROUP or n % 16:
        return None
    g = w.view(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    step = (hi - lo) / 15
    q = torch.round((g - lo[..., None]) / torch.where(step > 0, step, 1.0)[..., None]).clamp_(0, 15)
    err = (q * step[..., None] + lo[..., None] - g).abs()
    if bool((err > 0.15 * step[..., None] + 1e-12).any()):
        return None  # not 4-bit data (a float checkpoint; rounding to bf16 stays far below this): keep bf16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(n, k).to(torch.int32), 1)
    scales_zeros = torch.stack([step, lo + 8 * step], dim=-1).transpose(0, 1).contiguous().to(weight.dtype)
    return packed, scales_zeros


def _pack_parts(parts: dict[int, tuple | None] | None, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The packed 4-bit form of a (possibly fused) projection whose every part find_q4 recovered, else None."""
    if not parts or any(p is None for p in parts.values()):
        return None
    ordered = [parts[start] for start in sorted(parts)]
    q, s, m = (torch.cat([p[i] for p in ordered]) for i in range(3))
    if tuple(q.shape) != tuple(shape):
        return None
    return pack_q4(q, s, m)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.cpu_kernels = False  # fused rotary (torch.ops.kvfleet_cpu); set by enable_cpu_kernels

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], kv_cache, meta: AttentionMetadata, backend):
        """rope: (cos, sin) per token, or with the fused CPU kernels (positions, cos_sin table)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        rotated = self.num_heads + self.num_kv_heads
        if self.cpu_kernels:
            torch.ops.kvfleet_cpu.rotary_(qkv, rope[0], rope[1], rotated, self.head_dim)
            qkv = qkv.view(t, rotated + self.num_kv_heads, self.head_dim)
            q, k = qkv[:, : self.num_heads], qkv[:, self.num_heads:rotated]
        else:
            qkv = qkv.view(t, rotated + self.num_kv_heads, self.head_dim)
            qk = apply_rope(qkv[:, :rotated], *rope)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, rotated:]
        k_cache, v_cache = kv_cache
        backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = backend.forward(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.cpu_kernels = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernels:
            return self.down_proj(torch.ops.kvfleet_cpu.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.cpu_kernels = False
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, residual, rope, kv_cache, meta, backend):
        """(h, residual) -> (h, residual): the residual stream travels beside the sublayer output, so the
        add that joins them fuses with the next norm. The same additions as HF's layer, in the same order."""
        if self.cpu_kernels:
            ops = torch.ops.kvfleet_cpu
            if residual is None:
                residual, h = h, ops.rms_norm(h, self.input_layernorm.weight_f32, self.input_layernorm.eps)
            else:
                ops.add_rms_norm_(h, residual, self.input_layernorm.weight_f32, self.input_layernorm.eps)
            h = self.self_attn(h, rope, kv_cache, meta, backend)
            ops.add_rms_norm_(h, residual, self.post_attention_layernorm.weight_f32, self.post_attention_layernorm.eps)
            return self.mlp(h), residual
        residual = h if residual is None else residual + h
        h = self.self_attn(self.input_layernorm(residual), rope, kv_cache, meta, backend)
        residual = residual + h
        return self.mlp(self.post_attention_layernorm(residual)), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_model_len: int, hf_config=None):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope = RotaryEmbedding(config, max_model_len, hf_config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._lm_head_packed: torch.Tensor | None = None
        self._q4_parts: dict[str, dict[int, tuple | None]] = {}  # load_weights -> prepack_weights
        self._q8_lm_head: tuple[torch.Tensor, torch.Tensor] | None = None  # (q, d) found by load_weights
        self._lm_head_q8_packed: tuple[torch.Tensor, torch.Tensor] | None = None
        self._lm_head_q8: tuple[torch.Tensor, torch.Tensor] | None = None  # packed, once the AMX kernel runs
        self.cpu_kernels = False
        self._cos_sin: torch.Tensor | None = None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, backend, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits [len(logits_indices), vocab] for the selected rows of the flattened batch."""
        h = self.embed_tokens(input_ids)
        rope = (positions, self._cos_sin) if self.cpu_kernels else self.rope(positions, h.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, rope, kv_cache, meta, backend)
        if logits_indices is not None:
            h, residual = h[logits_indices], residual[logits_indices]
        if self.cpu_kernels:
            torch.ops.kvfleet_cpu.add_rms_norm_(h, residual, self.norm.weight_f32, self.norm.eps)
        else:
            h = self.norm(residual + h)
        if self._lm_head_q8 is not None and h.shape[0] <= Q8_HEAD_MAX_ROWS:
            # float32 logits straight from the float32 sums: bf16 logits (spacing 0.125 at 16-32) tie close tokens
            return torch.ops.kvfleet_cpu.q8_linear(h, self._lm_head_q8[0], self._lm_head_q8[1], None, True, True)
        if self._lm_head_packed is not None:
            return torch.ops.mkldnn._linear_pointwise(h, self._lm_head_packed, None, "none", [], "").float()
        return F.linear(h, self.lm_head_weight).float()

    def prepack_weights(self) -> bool:
        """Pre-pack every projection for oneDNN when that is the fast path (bf16 on CPU); True if done.
        Projections whose checkpoint values were exact 4-bit groups (seen by load_weights) also get a
        packed 4-bit copy, which enable_cpu_kernels puts to use."""
        weight = self.embed_tokens.weight
        parts, self._q4_parts = self._q4_parts, {}
        if not can_prepack(weight.dtype, weight.device):
            return False
        for name, module in self.named_modules():
            if isinstance(module, Linear):
                module.packed = prepack(module.weight)
                module.q4_packed = _pack_parts(parts.get(f"{name}.weight"), module.weight.shape)
                module.int4 = exact_int4(module.weight)
        self._lm_head_packed = prepack(self.lm_head_weight)
        found, self._q8_lm_head = self._q8_lm_head, None
        if found is not None and tuple(found[0].shape) == tuple(self.lm_head_weight.shape):
            self._lm_head_q8_packed = pack_q8(*found)
        return True

    def enable_cpu_kernels(self) -> None:
        """Run norms, residual adds, rotary and SiLU through the fused CPU kernels (torch.ops.kvfleet_cpu,
        loaded by engine.kernels.cpu_ops); they compute in float32 and round once, so reduced-precision
        results differ from the plain path in the last bit."""
        half = self.config.head_dim // 2
        self._cos_sin = torch.cat((self.rope.cos[:, :half], self.rope.sin[:, :half]), dim=1).float().contiguous()
        amx = bool(torch.ops.kvfleet_cpu.quant_amx()) and os.environ.get(QUANT_ENV, "auto") != "off"
        for module in self.modules():
            if hasattr(module, "cpu_kernels"):
                module.cpu_kernels = True
            if isinstance(module, RMSNorm):
                module.weight_f32 = module.weight.detach().float().contiguous()
            if isinstance(module, Linear) and module.q4_packed is not None and amx:
                module.q4 = module.q4_packed
        if amx:
            self._lm_head_q8 = self._lm_head_q8_packed

    @property
    def q4_projections(self) -> int:
        """How many projections multiply through their packed 4-bit weights."""
        return sum(1 for m in self.modules() if isinstance(m, Linear) and m.q4 is not None)

    @property
    def q8_lm_head(self) -> bool:
        """Whether the logits come from the checkpoint's packed 8-bit output weights."""
        return self._lm_head_q8 is not None

    # ---- weights -------------------------------------------------------------------------------

    def load_weights(self, weights) -> None:
        """Copy (HF name, tensor) pairs in, fusing q/k/v and gate/up; every parameter must be filled."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        cfg = self.config
        # float32 checkpoint values of a bf16 CPU model: look for exact 4/8-bit groups (prepack_weights packs them)
        capture_q4 = can_prepack(self.embed_tokens.weight.dtype, self.embed_tokens.weight.device)
        self._q4_parts, self._q8_lm_head = {}, None
        lm_head_name = "embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        fused = {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv), "v_proj": ("qkv_proj", q + kv, kv),
                 "gate_proj": ("gate_up_proj", 0, cfg.intermediate_size),
                 "up_proj": ("gate_up_proj", cfg.intermediate_size, cfg.intermediate_size)}
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            parts = name.split(".")
            target, start, size = name, None, None
            if len(parts) >= 2 and parts[-2] in fused:
                fused_name, start, size = fused[parts[-2]]
                target = ".".join(parts[:-2] + [fused_name, parts[-1]])
            if target not in params:
                raise UnsupportedModelError(f"checkpoint tensor {name!r} has no place in the model")
            dst = params[target].data if start is None else params[target].data[start:start + size]
            if dst.shape != tensor.shape:
                raise UnsupportedModelError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                            f"expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            filled.add(f"{target}:{start}")
            if capture_q4 and target.endswith("_proj.weight"):
                self._q4_parts.setdefault(target, {})[start or 0] = find_q4(tensor)
            if capture_q4 and target == lm_head_name:
                self._q8_lm_head = find_q8(tensor)
        expected = set()
        for pname in params:
            if pname.endswith("qkv_proj.weight") or pname.endswith("qkv_proj.bias"):
                expected |= {f"{pname}:0", f"{pname}:{q}", f"{pname}:{q + kv}"}
            elif pname.endswith("gate_up_proj.weight") or pname.endswith("gate_up_proj.bias"):
                expected |= {f"{pname}:0", f"{pname}:{cfg.intermediate_size}"}
            else:
                expected.add(f"{pname}:None")
        missing = sorted(expected - filled)
        if missing:
            raise UnsupportedModelError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")

"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over a flattened, paged batch.

One forward pass takes the new tokens of every scheduled sequence flattened into one row each
(prefill chunks and decode tokens mixed), writes their K/V into the paged cache through the attention
backend and reads each sequence's context back from it. Logits are computed only for the rows the
engine samples from (`logits_indices`). Q/K/V and gate/up projections are fused into one matmul each.
The arithmetic follows Hugging Face's implementation op for op, so float32 outputs match it.

This file holds the architecture only. Faster implementations of its layers (fused CPU kernels, pre-packed
and 4/8-bit projections) replace these modules once, at load, from `engine/model/cpu_layers.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.metadata import AttentionMetadata

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
        # on the CPU whatever the default device: on the meta device this division would import torch._dynamo
        inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
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
        device = torch.get_default_device()  # the tables are computed where inv_freq is, then moved there
        freqs = torch.arange(max_len, dtype=torch.float32, device=inv_freq.device)[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(device), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] for the tokens at positions [T], once per forward pass."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (HF's rotate_half convention, same op order)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class QKRotary(nn.Module):
    """Splits a fused qkv projection [T, (H + 2 * Hkv) * D] into q, k, v heads, q and k rotated."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

    def forward(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        rotated = self.num_heads + self.num_kv_heads
        qkv = qkv.view(qkv.shape[0], rotated + self.num_kv_heads, self.head_dim)
        qk = apply_rope(qkv[:, :rotated], *rope)
        return qk[:, : self.num_heads], qk[:, self.num_heads:], qkv[:, rotated:]


class RMSNorm(nn.Module):
    """RMSNorm of the residual stream: given the sublayer output x and the stream so far, returns
    (norm(stream + x), stream + x); the first layer passes residual=None (the stream starts at x)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x if residual is None else residual + x
        # float32: bit-identical to HF's op sequence; reduced precision: one fused op (accumulates in float32)
        return F.rms_norm(residual, self.weight.shape, self.weight, self.eps), residual


class SiluAndMul(nn.Module):
    """silu(gate) * up for the fused gate/up projection [T, 2 * I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class OutputHead(nn.Module):
    """Float32 logits: the final hidden states times the output weights (the embedding's when tied)."""

    def forward(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(h, weight).float()


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.rotary = QKRotary(self.num_heads, self.num_kv_heads, self.head_dim)
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def forward(self, x, rope, kv_cache, meta: AttentionMetadata, backend):
        """rope: what the model's RotaryEmbedding gave for this step's positions."""
        t = x.shape[0]
        q, k, v = self.rotary(self.qkv_proj(x), rope)
        k_cache, v_cache = kv_cache
        backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = backend.forward(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, residual, rope, kv_cache, meta, backend):
        """(h, residual) -> (h, residual): the residual stream travels beside the sublayer output, so the
        add that joins them fuses with the next norm. The same additions as HF's layer, in the same order."""
        h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, rope, kv_cache, meta, backend)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_model_len: int, hf_config=None):
        super().__init__()
        self.config = config
        # no random init (load_weights fills every parameter, or says which it lacks); on the meta device the
        # embedding's normal_ would import torch._dynamo, two seconds of every engine start
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope = RotaryEmbedding(config, max_model_len, hf_config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.output_head = OutputHead()
        # (h, rope, kv_caches, meta, backend) -> (h, residual) after every layer, or None: the layers below run.
        # Set at load where a faster runner of whole steps applies (engine/model/cpu_decode_stack.py).
        self.decode_stack: Callable | None = None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, backend, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits [len(logits_indices), vocab] for the selected rows of the flattened batch."""
        h = self.embed_tokens(input_ids)
        rope = self.rope(positions, h.dtype)
        stacked = None if self.decode_stack is None else self.decode_stack(h, rope, kv_caches, meta, backend)
        if stacked is not None:
            h, residual = stacked
        else:
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                h, residual = layer(h, residual, rope, kv_cache, meta, backend)
        if logits_indices is not None:
            h, residual = h[logits_indices], residual[logits_indices]
        h, _ = self.norm(h, residual)
        return self.output_head(h, self.lm_head_weight)

    # ---- weights -------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     observe: Callable[[str, int, torch.Tensor], None] | None = None) -> None:
        """Copy (HF name, tensor) pairs in, fusing q/k/v and gate/up; every parameter must be filled.
        observe(parameter name, first row, checkpoint tensor) sees each tensor as it is copied."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        cfg = self.config
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
            if observe is not None:
                observe(target, start or 0, tensor)
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

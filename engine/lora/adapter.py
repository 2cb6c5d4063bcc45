"""A LoRA adapter in PEFT's format, read and checked against the base model.

A directory holds `adapter_config.json` (r, lora_alpha, target_modules, use_rslora, ...) and
`adapter_model.safetensors` with `...layers.{i}.{self_attn|mlp}.{module}.lora_A.weight` [r, in] and
`lora_B.weight` [out, r]. Supported targets: the attention and MLP projections (q, k, v, o, gate, up,
down); ranks up to the engine's --max-lora-rank; per-module ranks (`rank_pattern`) are read from the
tensors. The scale (alpha / r, or alpha / sqrt(r) with rsLoRA) is folded into B once, here. Anything
else (DoRA, biases, modules_to_save, embeddings, the output head) is refused with a LoRAError naming
the field, as is a tensor whose shape does not fit the base model.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from engine.errors import LoRAError
from engine.model.llama import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclass(frozen=True)
class LoRAWeights:
    """One adapter's tensors: (layer, module) -> (A [r, in], B * scale [out, r]), on the CPU."""

    rank: int  # the largest rank of any module
    modules: tuple[str, ...]  # the target modules it has tensors for
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.tensors.values())


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of one of the base model's projections."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[module]


def read_config(path: str) -> dict:
    """The adapter's adapter_config.json, checked for what this engine serves (LoRAError if not)."""
    if not isinstance(path, str) or not path:
        raise LoRAError("lora_path", "lora_path must be a non-empty string")
    if not os.path.isdir(path):
        raise LoRAError("lora_path", f"lora_path {path!r} is not a directory")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not os.path.isfile(os.path.join(path, name)):
            raise LoRAError("lora_path", f"lora_path {path!r} has no {name} (a PEFT LoRA adapter directory holds "
                                         f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        with open(os.path.join(path, CONFIG_FILE)) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAError("lora_path", f"{CONFIG_FILE} in {path!r} is not readable JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAError("lora_path", f"{CONFIG_FILE} in {path!r} is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError("peft_type", f"peft_type {cfg.get('peft_type')!r} is not supported; only LORA adapters are")
    if cfg.get("use_dora"):
        raise LoRAError("use_dora", "DoRA adapters (use_dora) are not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAError("bias", f"adapters with biases (bias={cfg.get('bias')!r}) are not supported")
    if cfg.get("modules_to_save"):
        raise LoRAError("modules_to_save", f"modules_to_save {cfg['modules_to_save']!r} is not supported: only "
                                           f"LoRA products on {', '.join(TARGET_MODULES)}")
    if cfg.get("fan_in_fan_out"):
        raise LoRAError("fan_in_fan_out", "fan_in_fan_out adapters (Conv1D bases) are not supported")
    if cfg.get("alpha_pattern"):
        raise LoRAError("alpha_pattern", "per-module lora_alpha (alpha_pattern) is not supported")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise LoRAError("lora_alpha", f"lora_alpha must be a positive number, got {alpha!r}")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        bad = [t for t in targets if t not in TARGET_MODULES]
        if bad:
            raise LoRAError("target_modules", f"target module(s) {bad} are not supported; supported: "
                                              f"{', '.join(TARGET_MODULES)}")
    return cfg


def load_adapter(path: str, config: ModelConfig, max_rank: int, dtype: torch.dtype = torch.float32) -> LoRAWeights:
    """Read and check the adapter at path against the base model's config; LoRAError names what is wrong."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    cfg = read_config(path)
    try:
        state = load_file(os.path.join(path, WEIGHTS_FILE))
    except (OSError, SafetensorError) as e:
        raise LoRAError("lora_path", f"{WEIGHTS_FILE} in {path!r} is not a readable safetensors file: {e}") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        m = _KEY.search(key)
        if m is None:
            raise LoRAError("target_modules", f"tensor {key!r} is not a LoRA product of a decoder layer's projection; "
                                              f"supported: {', '.join(TARGET_MODULES)}")
        layer, module, half = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGET_MODULES:
            raise LoRAError("target_modules", f"target module {module!r} (tensor {key!r}) is not supported; "
                                              f"supported: {', '.join(TARGET_MODULES)}")
        if layer >= config.num_layers:
            raise LoRAError("lora_path", f"tensor {key!r} is for layer {layer}, but the base model has "
                                         f"{config.num_layers} layers (an adapter for another base model?)")
        halves.setdefault((layer, module), {})[half] = tensor
    if not halves:
        raise LoRAError("lora_path", f"{WEIGHTS_FILE} in {path!r} holds no LoRA tensors")
    alpha, rslora = float(cfg.get("lora_alpha", 8)), bool(cfg.get("use_rslora", False))
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    rank = 0
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAError("lora_path", f"layer {layer} {module} has lora_{''.join(pair)} but not both A and B")
        a, b = pair["A"], pair["B"]
        fan_in, fan_out = module_shape(config, module)
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or b.shape != (fan_out, r):
            raise LoRAError("lora_path", f"layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B "
                                         f"{tuple(b.shape)} do not fit the base model's projection ({fan_in} -> "
                                         f"{fan_out}: expected [r, {fan_in}] and [{fan_out}, r]); an adapter "
                                         f"trained on another base model?")
        if r > max_rank:
            raise LoRAError("r", f"rank {r} ({module} of layer {layer}) exceeds --max-lora-rank {max_rank}")
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        tensors[(layer, module)] = (a.to(dtype).contiguous(), (b.float() * scale).to(dtype).contiguous())
        rank = max(rank, r)
    modules = tuple(m for m in TARGET_MODULES if any(k[1] == m for k in tensors))
    return LoRAWeights(rank, modules, tensors)

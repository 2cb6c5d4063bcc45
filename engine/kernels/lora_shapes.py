"""The projections LoRA wraps and their shapes (the fused names of engine/model/llama.py): what the wrapper
(engine/lora/layers.py) and the enumeration of the Triton variants (engine/kernels/variants.py) both need.
config: a ModelConfig (duck-typed: num_heads, num_kv_heads, head_dim, hidden_size, intermediate_size)."""

from __future__ import annotations


def part_sizes(config, fused: str) -> list[int]:
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"qkv_proj": [q, kv, kv], "o_proj": [config.hidden_size],
            "gate_up_proj": [config.intermediate_size] * 2, "down_proj": [config.hidden_size]}[fused]


def fan_in(config, fused: str) -> int:
    """The input width of a wrapped projection."""
    if fused == "down_proj":
        return config.intermediate_size
    return config.num_heads * config.head_dim if fused == "o_proj" else config.hidden_size


LORA_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # the fused names attach_lora wraps

"""A checkpoint's config.json as the decoder reads it, without importing transformers' model configs.

    cfg = read_config(directory)        # attribute access like a transformers config: cfg.hidden_size, ...

Importing transformers' Llama/Mistral/Qwen2 config classes pulls in torch.distributed and dynamo (about two
seconds of every engine start). The decoder reads a handful of fields (ModelConfig.from_hf), so they are read
here from the JSON with the defaults those classes give a field the file leaves out (DEFAULTS; a test holds
them against transformers). A checkpoint whose rope is scaled (llama3, yarn, dynamic, ...) is the exception:
its inverse frequencies come from transformers' own rope functions, which need transformers' config object,
so `read_config` returns None for it and the loader asks transformers.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

# what transformers 5's LlamaConfig / MistralConfig / Qwen2Config give each field ModelConfig.from_hf reads
_COMMON = {"vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000.0,
           "attention_bias": False, "mlp_bias": False}
DEFAULTS: dict[str, dict] = {
    "llama": {**_COMMON, "intermediate_size": 11008, "max_position_embeddings": 2048, "sliding_window": None},
    "mistral": {**_COMMON, "intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                "sliding_window": 4096},
    "qwen2": {**_COMMON, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
              "max_position_embeddings": 32768,
              "sliding_window": 4096, "use_sliding_window": False},
}


def read_config(directory: str) -> SimpleNamespace | None:
    """The config of the checkpoint in `directory`, or None where transformers must read it (a model type
    not in DEFAULTS or none at all, which it or ModelConfig.from_hf then names, or a scaled rope)."""
    with open(os.path.join(directory, "config.json")) as f:
        raw = json.load(f)
    model_type = raw.get("model_type")
    if model_type not in DEFAULTS:
        return None
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return None
    cfg = {**DEFAULTS[model_type], **{k: v for k, v in raw.items() if v is not None or k == "sliding_window"}}
    heads = cfg["num_attention_heads"]
    cfg["model_type"] = model_type
    cfg["num_key_value_heads"] = raw.get("num_key_value_heads") or cfg.get("num_key_value_heads") or heads
    cfg["head_dim"] = raw.get("head_dim") or cfg["hidden_size"] // heads
    theta = rope.get("rope_theta", raw.get("rope_theta") or DEFAULTS[model_type]["rope_theta"])
    cfg["rope_parameters"] = {**rope, "rope_theta": theta, "rope_type": "default"}
    cfg.pop("rope_scaling", None)
    if model_type == "qwen2" and not cfg.get("use_sliding_window"):
        cfg["sliding_window"] = None  # Qwen2's window applies only with use_sliding_window
    cfg.setdefault("use_sliding_window", True)
    return SimpleNamespace(**cfg)

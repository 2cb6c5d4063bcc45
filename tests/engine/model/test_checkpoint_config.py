"""The checkpoint config read from config.json (engine/model/checkpoint_config.py) gives the decoder exactly the
ModelConfig that transformers' own config classes give, for every supported model type, with fields left out
(the class defaults), set, old-style (`rope_theta` at the top, `rope_scaling`) and null; a scaled rope and an
unknown model type are left to transformers."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from engine.model.checkpoint_config import read_config
from engine.model.llama import ModelConfig

SMOLLM2 = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
           "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
           "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}
SMALL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4}

CASES = {
    "smollm2": SMOLLM2,
    "llama-minimal": {"model_type": "llama"},
    "llama-old-rope": {"model_type": "llama", **SMALL, "rope_theta": 500000.0, "num_key_value_heads": 2,
                       "attention_bias": True, "mlp_bias": True},
    "llama-nulls": {"model_type": "llama", **SMALL, "num_key_value_heads": None, "head_dim": None,
                    "rope_scaling": None},
    "mistral-minimal": {"model_type": "mistral"},
    "mistral-window-null": {"model_type": "mistral", **SMALL, "sliding_window": None, "rope_theta": 1e6},
    "mistral-window": {"model_type": "mistral", **SMALL, "sliding_window": 2048},
    "qwen2-minimal": {"model_type": "qwen2"},
    "qwen2-window-off": {"model_type": "qwen2", **SMALL, "sliding_window": 1024, "use_sliding_window": False,
                         "tie_word_embeddings": True},
    "qwen2-window-on": {"model_type": "qwen2", **SMALL, "sliding_window": 1024, "use_sliding_window": True,
                        "max_window_layers": 2},
    "rope-type-default": {"model_type": "llama", **SMALL, "rope_scaling": {"rope_type": "default"}},
}


def _write(tmp_path, cfg: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize("name", list(CASES))
def test_the_decoder_config_is_transformers_own(tmp_path, name):
    directory = _write(tmp_path, CASES[name])
    fast = read_config(directory)
    assert fast is not None
    ours, theirs = ModelConfig.from_hf(fast), ModelConfig.from_hf(AutoConfig.from_pretrained(directory))
    assert ours == theirs
    assert ours.rope_theta == theirs.rope_theta and ours.rope_parameters.get("rope_type", "default") == "default"


@pytest.mark.parametrize("cfg", [
    {"model_type": "llama", **SMALL, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
    {"model_type": "llama", **SMALL, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
    {"model_type": "gemma", **SMALL},
    {**SMALL},  # no model_type: transformers says so
])
def test_scaled_ropes_and_other_model_types_are_left_to_transformers(tmp_path, cfg):
    assert read_config(_write(tmp_path, cfg)) is None


def test_a_broken_file_is_an_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError):
        read_config(str(tmp_path))

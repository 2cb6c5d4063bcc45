"""A tiny random-weight Llama checkpoint on disk (HF layout + SmolLM2's tokenizer) for fast engine tests."""

from __future__ import annotations

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def make_tiny_llama(path: str, seed: int = 0, **overrides) -> str:
    """Write config.json + model.safetensors + tokenizer files to `path`; returns it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.tokenizer import load_tokenizer

    cfg = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False,
               bos_token_id=1, eos_token_id=2, pad_token_id=2)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    with torch.no_grad():  # larger weights than the default init, so logits are far from uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(path, safe_serialization=True)
    load_tokenizer("smollm2").hf.save_pretrained(path)
    return path

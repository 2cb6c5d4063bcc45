"""Checkpoints laid out the way users have them, written by tests: sharded safetensors with an index (and a stray
`consolidated.safetensors`, as Mistral-7B-v0.3 ships), a Hugging Face hub cache, and a random bf16 Llama."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

INDEX = "model.safetensors.index.json"


def reshard(directory: str, num_shards: int = 3, stray_consolidated: bool = True) -> dict[str, str]:
    """Split directory/model.safetensors into num_shards files + index (the single file is removed); with
    stray_consolidated, add a consolidated.safetensors holding other values under the same names and a
    Mistral-style name. Returns the index's weight_map."""
    state = load_file(os.path.join(directory, "model.safetensors"))
    os.remove(os.path.join(directory, "model.safetensors"))
    names = list(state)
    per = -(-len(names) // num_shards)
    weight_map = {}
    for s in range(num_shards):
        file = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: state[n].contiguous() for n in names[s * per:(s + 1) * per]}
        save_file(part, os.path.join(directory, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    if stray_consolidated:
        garbage = {n: torch.full_like(t, 7.0) for n, t in state.items()}
        garbage["layers.0.attention.wq.weight"] = torch.zeros(4, 4)
        save_file(garbage, os.path.join(directory, "consolidated.safetensors"))
    return weight_map


def hub_cache(cache_dir: str, repo_id: str, model_dir: str, commit: str = "0123456789abcdef0123456789abcdef01234567"
              ) -> str:
    """Lay model_dir's files out as huggingface_hub does (blobs, snapshots/<commit>, refs/main); the snapshot."""
    folder = os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(folder, "snapshots", commit)
    os.makedirs(os.path.join(folder, "blobs"))
    os.makedirs(snapshot)
    os.makedirs(os.path.join(folder, "refs"))
    for i, name in enumerate(sorted(os.listdir(model_dir))):
        blob = os.path.join(folder, "blobs", f"blob{i:04d}")
        shutil.copyfile(os.path.join(model_dir, name), blob)
        os.symlink(os.path.relpath(blob, snapshot), os.path.join(snapshot, name))
    with open(os.path.join(folder, "refs", "main"), "w") as f:
        f.write(commit)
    return snapshot


def random_bf16_llama(path: str, hidden: int = 768, intermediate: int = 2048, layers: int = 24, vocab: int = 8192,
                      shards: int = 3) -> int:
    """A Llama checkpoint of constant bf16 weights (values do not matter for memory), sharded with an index;
    its size in bytes (24 layers of 768/2048 and an 8192 vocabulary: 327 MB)."""
    os.makedirs(path, exist_ok=True)
    heads, kv_heads = 12, 4
    head_dim = hidden // heads
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab, hidden_size=hidden,
                  intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, max_position_embeddings=1024, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, torch_dtype="bfloat16", hidden_act="silu", bos_token_id=1, eos_token_id=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (hidden, hidden),
                       p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                       p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                       p + "self_attn.o_proj.weight": (hidden, hidden),
                       p + "mlp.gate_proj.weight": (intermediate, hidden), p + "mlp.up_proj.weight": (intermediate, hidden),
                       p + "mlp.down_proj.weight": (hidden, intermediate),
                       p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)})
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    names = list(shapes)
    per = -(-len(names) // shards)
    weight_map, total = {}, 0
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: torch.full(shapes[n], 0.01 * (k % 7 + 1), dtype=torch.bfloat16)
                for k, n in enumerate(names[s * per:(s + 1) * per])}
        total += sum(t.numel() * t.element_size() for t in part.values())
        save_file(part, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
        del part
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total

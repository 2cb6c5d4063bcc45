"""Random-weight models with real architectures' shapes, built on the device: no checkpoint, no download.

`SHAPES` holds Llama-3-8B and Qwen2.5-7B (head_dim 128, GQA 4 and 7), the bundled SmolLM2-135M's shape and a
tiny shape for CPU smoke runs.
`model_dir` writes what the engine reads besides weights (config.json and a word-level tokenizer)
into a directory; `build` makes the decoder with random weights directly on the device, to hand to
LLMEngine as an already loaded model. Rotary embedding: the default (theta only; Llama-3's frequency
scaling is left out, which changes no shape or cost).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shape:
    name: str
    model_type: str  # "llama" or "qwen2"
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    rope_theta: float
    head_dim: int = 128

    def hf_config(self, layers: int | None = None, max_len: int = 8192):
        from transformers import LlamaConfig, Qwen2Config

        cls = LlamaConfig if self.model_type == "llama" else Qwen2Config
        return cls(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.ffn,
                   num_hidden_layers=layers or self.layers, num_attention_heads=self.heads,
                   num_key_value_heads=self.kv_heads, head_dim=self.head_dim, max_position_embeddings=max_len,
                   rope_theta=self.rope_theta, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
                   eos_token_id=2, torch_dtype="bfloat16")


SHAPES = {
    "llama3-8b": Shape("llama3-8b", "llama", 4096, 14336, 32, 32, 8, 128256, 500000.0),
    "qwen2.5-7b": Shape("qwen2.5-7b", "qwen2", 3584, 18944, 28, 28, 4, 152064, 1000000.0),
    # the bundled SmolLM2-135M's shape, for machines without its GGUF (a GPU machine compiling its kernels)
    "smollm2": Shape("smollm2", "llama", 576, 1536, 30, 9, 3, 49152, 100000.0, head_dim=64),
    "tiny": Shape("tiny", "llama", 256, 512, 2, 4, 1, 512, 10000.0, head_dim=64),
}


def model_dir(shape: Shape, path: str, layers: int | None = None, max_len: int = 8192) -> str:
    """config.json and a word-level tokenizer (ids 0-2 special, then one word per id up to the
    vocabulary size, so every id the model can emit is also a valid prompt token) in `path`, and an empty
    model.safetensors (the engine resolves a directory by it; the weights come from `build`)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    save_file({}, os.path.join(path, "model.safetensors"))
    shape.hf_config(layers, max_len).save_pretrained(path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, shape.vocab)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
                            ).save_pretrained(path)
    return path


@torch.inference_mode()
def build(shape: Shape, device: torch.device | str, dtype: torch.dtype = torch.bfloat16, layers: int | None = None,
          max_len: int = 8192, seed: int = 0):
    """(LlamaForCausalLM with random weights on `device`, hf_config): what LLMEngine(args, model=...) takes."""
    from engine.model.llama import LlamaForCausalLM, ModelConfig

    hf = shape.hf_config(layers, max_len)
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(ModelConfig.from_hf(hf), max_len)
    finally:
        torch.set_default_dtype(prev)
    for name, p in model.named_parameters():  # the default init, made explicit: small projections, unit norms
        if "norm" in name:
            p.fill_(1.0)
        elif p.dim() == 2:
            p.normal_(0.0, 0.02 if "embed" not in name else 1.0)
        else:
            p.normal_(0.0, 0.02)
    return model.eval(), hf

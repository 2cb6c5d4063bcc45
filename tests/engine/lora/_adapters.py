"""LoRA adapters on SmolLM2 for the tests, in PEFT's format.

ADAPTERS: three adapters (ranks 8, 16 and 64, different target modules, non-zero B from a fixed seed: PEFT
starts B at zero, which would make every adapter the base model), either made by `peft` on the Hugging Face
model (`make_adapters`) or written straight to disk from the same recipe (`write_adapters`, no model needed).
`peft_greedy` gives PEFT's greedy tokens for any of them: the reference the engine must equal."""

from __future__ import annotations

import os

import torch

# name -> (rank, alpha, target modules); alpha / r = 2: folding the scale into B is exact in float32
ADAPTERS = {
    "attn-r8": (8, 16, ["q_proj", "v_proj"]),
    "mlp-r16": (16, 32, ["gate_proj", "up_proj", "down_proj"]),
    "all-r64": (64, 128, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}
B_STD = 0.08


def hf_base(source):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return AutoModelForCausalLM.from_pretrained(source.directory, gguf_file=source.gguf_file,
                                                dtype=torch.float32).eval()


def make_adapters(base, directory: str, seed: int = 0):
    """Every adapter of ADAPTERS on the HF model `base`, written under directory/<name>; (the PEFT model holding
    them all, {name: path})."""
    from peft import LoraConfig, get_peft_model

    peft_model = None
    paths = {}
    for i, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items()):
        cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none")
        torch.manual_seed(seed + i)
        if peft_model is None:
            peft_model = get_peft_model(base, cfg, adapter_name=name)
        else:
            peft_model.add_adapter(name, cfg)
        gen = torch.Generator().manual_seed(seed + 100 + i)
        with torch.no_grad():
            for pname, p in peft_model.named_parameters():
                if f"lora_B.{name}." in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) * B_STD)
        out = os.path.join(directory, name)
        peft_model.save_pretrained(out, selected_adapters=[name])
        nested = os.path.join(out, name)
        paths[name] = nested if os.path.isdir(nested) else out
    peft_model.eval()
    return peft_model, paths


def write_adapters(directory: str, seed: int = 0) -> dict[str, str]:
    """Every adapter of ADAPTERS written in PEFT's format without any model; {name: path}."""
    return {name: write_adapter(os.path.join(directory, name), rank, targets, seed=seed + i, alpha=alpha)
            for i, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items())}


def peft_model_of(base, paths: dict[str, str]):
    """The HF model with the adapters at paths loaded by PEFT (PeftModel.from_pretrained / load_adapter)."""
    from peft import PeftModel

    model = None
    for name, path in paths.items():
        if model is None:
            model = PeftModel.from_pretrained(base, path, adapter_name=name)
        else:
            model.load_adapter(path, adapter_name=name)
    return model.eval()


def peft_greedy(peft_model, name: str | None, prompts: list[list[int]], new_tokens: int, pad: int = 2
                ) -> list[list[int]]:
    """Greedy tokens of the HF model under adapter `name` (None: the base), one left-padded batch."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kw = dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=pad)
    with torch.inference_mode():
        if name is None:
            with peft_model.disable_adapter():
                out = peft_model.generate(input_ids=ids, attention_mask=mask, **kw)
        else:
            peft_model.set_adapter(name)
            out = peft_model.generate(input_ids=ids, attention_mask=mask, **kw)
    return out[:, width:].tolist()


# SmolLM2-135M's projection shapes (in, out), for adapters written without loading any model
SMOLLM2 = {"layers": 30, "q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192), "o_proj": (576, 576),
           "gate_proj": (576, 1536), "up_proj": (576, 1536), "down_proj": (1536, 576)}


def write_adapter(directory: str, rank: int = 8, targets=("q_proj", "v_proj"), seed: int = 0, b_std: float = B_STD,
                  shapes: dict = SMOLLM2, alpha: int | None = None, **config) -> str:
    """A PEFT-format adapter written directly (safetensors + adapter_config.json), random A and B; its directory.
    config: adapter_config.json fields to add or override."""
    import json

    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shapes["layers"]):
        for module in targets:
            fan_in, fan_out = shapes[module]
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * b_std
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha or 2 * rank, "target_modules": list(targets),
           "bias": "none", "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", **config}
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    return directory

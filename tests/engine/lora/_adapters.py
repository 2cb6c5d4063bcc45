"""Three PEFT LoRA adapters on SmolLM2, made by the tests: ranks 8, 16 and 64, different target modules,
non-zero B from a fixed seed (PEFT starts B at zero, which would make every adapter the base model)."""

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

"""Load a model's config and weights (HF safetensors directory or GGUF file) into our decoder.

The decoder is built on the meta device, cast to the target dtype there, and only then given real memory
(`_on_device`), so a bf16 model never exists in float32 on the device; weights then stream in shard by shard
through the checkpoint's index (engine/model/checkpoint.py). Peak memory is the model in its dtype plus one
checkpoint tensor.

A GGUF file is read through transformers (which dequantizes it to float32 and undoes llama.cpp's Q/K
permutation); the result is cached on disk as config.json + model.safetensors (KVFLEET_CACHE_DIR,
default ~/.cache/kvfleet, keyed by path, size and mtime), so later starts read it like an HF directory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from functools import cache

import torch

from engine.model.checkpoint import iter_tensors
from engine.model.checkpoint_config import read_config
from engine.model.cpu_linear import QuantCapture, can_prepack, prepack
from engine.model.llama import LlamaForCausalLM, ModelConfig, RotaryEmbedding, UnsupportedModelError
from engine.model.registry import ModelNotFoundError, ModelSource

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@cache
def cpu_has_native_bf16() -> bool:
    """AVX-512 BF16 or AMX: bf16 matmul runs at several times the fp32 rate on this CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """`auto` is bf16 on GPUs and on CPUs with native bf16 matmul, float32 otherwise."""
    if name == "auto":
        if torch.device(device).type == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"--dtype must be one of auto, {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]


def load_hf_config(source: ModelSource):
    """The checkpoint's config: read from its config.json (engine/model/checkpoint_config.py), or by
    transformers where that module says it must be."""
    directory = checkpoint_dir(source)
    try:
        fast = read_config(directory)
        if fast is not None:
            return fast
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(directory)
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(f"could not read the model config in {directory}: {e}") from e


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device | str = "cpu",
               max_model_len: int | None = None, cpu_prepack: bool = True,
               hf_config=None) -> tuple[LlamaForCausalLM, object]:
    """Build the decoder for `source` in `dtype` on `device` and fill its weights. Returns (model, hf_config).
    cpu_prepack=False skips the oneDNN copies of bf16 projections on CPUs (which hold the weights a second time);
    hf_config: load_hf_config(source) where the caller has read it already."""
    hf_config = hf_config if hf_config is not None else load_hf_config(source)
    config = ModelConfig.from_hf(hf_config)
    max_len = max_model_len or config.max_position_embeddings
    with torch.device("meta"):  # no random init: every parameter is overwritten by the checkpoint
        model = LlamaForCausalLM(config, max_len, hf_config)
    model = _on_device(model.to(dtype), device)  # cast while on meta: memory only in the target dtype
    with torch.device(device):  # cos/sin tables in float32, cast per token like HF
        model.rope = RotaryEmbedding(config, max_len, hf_config)
    # bf16 on CPU: oneDNN pre-packed projections, and the exact 4/8-bit groups of the float32 checkpoint kept
    capture = QuantCapture(config) if cpu_prepack and can_prepack(dtype, device) else None
    model.load_weights(iter_tensors(checkpoint_dir(source), device), capture)
    model.eval().requires_grad_(False)
    if capture is not None:
        prepack(model, capture)
        logger.info("projections pre-packed for oneDNN (bf16 on CPU)")
    return model, hf_config


def _on_device(model: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """The meta-device model's parameters and buffers given uninitialised memory on `device`, in place (what
    `Module.to_empty` does, without its per-tensor Python decomposition of empty_like on meta tensors and the
    symbolic-shapes import it pulls in: 0.36 s and about as much again at every engine start)."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None:
                    continue
                empty = torch.empty(t.shape, dtype=t.dtype, device=device)
                table[name] = torch.nn.Parameter(empty, t.requires_grad) if isinstance(t, torch.nn.Parameter) else empty
    return model


def checkpoint_dir(source: ModelSource) -> str:
    """A directory with config.json + safetensors for `source` (the GGUF cache for GGUF files)."""
    if not source.is_gguf:
        return source.directory
    cache_dir = _gguf_cache_dir(source)
    if not os.path.isfile(os.path.join(cache_dir, "model.safetensors")):
        _convert_gguf(source, cache_dir)
    return cache_dir


def _gguf_cache_dir(source: ModelSource) -> str:
    try:
        st = os.stat(source.path)
    except OSError as e:
        raise ModelNotFoundError(f"GGUF file {source.path} cannot be read: {e}") from e
    key = hashlib.sha256(f"{source.path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    root = os.environ.get("KVFLEET_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvfleet")
    return os.path.join(root, "models", key)


def _convert_gguf(source: ModelSource, cache_dir: str) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    logger.info("converting %s to float32 safetensors in %s (once)", source.path, cache_dir)
    try:
        hf = AutoModelForCausalLM.from_pretrained(source.directory, gguf_file=source.gguf_file,
                                                  dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise UnsupportedModelError(f"could not load the GGUF file {source.path} through transformers "
                                    f"(expected a Llama-family GGUF): {e}") from e
    state = {k: v.contiguous() for k, v in hf.state_dict().items()
             if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
    os.makedirs(os.path.dirname(cache_dir), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(cache_dir))
    try:
        hf.config.save_pretrained(tmp)
        save_file(state, os.path.join(tmp, "model.safetensors"))
        os.rename(tmp, cache_dir)
    except OSError:
        if not os.path.isfile(os.path.join(cache_dir, "model.safetensors")):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

"""LoRA on the fast CPU layers (the `cpu` backend: fused C++ kernels, oneDNN / int4 projections in bf16): in
float32 the greedy tokens under each adapter, in one mixed batch, equal the torch backend's (which equal
PEFT's, test_lora_exactness.py); in bf16 every adapter changes the output and a mixed batch runs. Slow: two
engines on SmolLM2."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from engine import SamplingParams  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.lora.layers import LoRALinear  # noqa: E402
from engine.lora.request import LoRARequest  # noqa: E402
from engine.model.cpu_layers import uses_cpu_kernels  # noqa: E402
from tests.engine.lora._adapters import ADAPTERS, write_adapters  # noqa: E402

pytestmark = [pytest.mark.model, pytest.mark.slow]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about autumn."]
NAMES = [None, *ADAPTERS]


def _run(llm, paths) -> list[list[int]]:
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    jobs = [(p, name) for p in prompts for name in NAMES]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                             lora=None if name is None else LoRARequest(name, NAMES.index(name), paths[name]))
              for _, name in jobs]
    return [o.outputs[0].token_ids for o in llm.generate([p for p, _ in jobs], params)]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_adapters(str(tmp_path_factory.mktemp("adapters")))


def _llm(dtype: str, backend: str) -> LLM:
    torch.set_num_threads(1)
    return LLM("smollm2", dtype=dtype, attention_backend=backend, max_model_len=512, num_blocks=256, seed=0,
               num_threads=1, enable_lora=True, max_loras=4, max_lora_rank=64)


def test_float32_fast_layers_equal_the_torch_backend(paths):
    fast = _llm("float32", "cpu")
    assert uses_cpu_kernels(fast.engine.model)
    assert isinstance(fast.engine.model.layers[0].self_attn.qkv_proj, LoRALinear)
    got = _run(fast, paths)
    del fast
    assert got == _run(_llm("float32", "torch"), paths)


def test_bfloat16_fast_layers_serve_adapters(paths):
    llm = _llm("bfloat16", "cpu")
    out = _run(llm, paths)
    rows = [out[i::len(NAMES)] for i in range(len(NAMES))]  # per adapter, every prompt
    for i in range(1, len(NAMES)):
        assert rows[i] != rows[0], f"{NAMES[i]} gives the base model's tokens in bf16"

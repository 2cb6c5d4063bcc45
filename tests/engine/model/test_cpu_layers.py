"""The CPU fast paths are chosen once, at load, by swapping modules: the model file holds the architecture
only, and the C++ kernels are reached only through engine.kernels.cpu_ops."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from torch import nn

from engine.kernels import cpu_ops
from engine.model import cpu_layers, cpu_linear, llama

ROOT = Path(__file__).resolve().parents[3]

if os.environ.get(cpu_ops.ENV) == "torch":
    pytest.skip("fused CPU kernels turned off", allow_module_level=True)


def test_the_model_file_knows_nothing_of_cpu_fast_paths():
    text = Path(llama.__file__).read_text()
    for word in ("kvfleet_cpu", "cpu_ops", "mkldnn", "int4", "q4", "q8", "cpu_kernels", "import os"):
        assert word not in text, word
    assert not re.search(r"^\s*(from|import) engine\.(kernels|model\.(cpu_|quantized))", text, re.M)


def test_only_cpu_ops_names_the_kernel_library():
    library = "torch.ops." + "kvfleet_cpu"  # spelled apart, so this file does not name it
    named = [p.relative_to(ROOT).as_posix() for folder in ("engine", "router", "loadtest", "deploy", "tests")
             for p in (ROOT / folder).rglob("*.py") if library in p.read_text()]
    assert named == ["engine/kernels/cpu_ops.py"]


def _plain_types(model: nn.Module) -> set[type]:
    return {type(m) for m in model.modules()} & {llama.RMSNorm, llama.QKRotary, llama.SiluAndMul,
                                                  llama.RotaryEmbedding, llama.OutputHead, nn.Linear}


def test_bf16_load_packs_projections_and_the_cpu_backend_swaps_in_the_fused_layers(tmp_path):
    from engine.llm import LLM
    from tests.engine._tiny_llama import make_tiny_llama

    path = make_tiny_llama(str(tmp_path / "m"))
    plain = LLM(path, dtype="bfloat16", attention_backend="torch", num_blocks=32).engine.model
    layer = plain.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, cpu_linear.OneDnnLinear)  # random weights: no exact 4-bit groups
    assert isinstance(plain.output_head, cpu_linear.OneDnnHead)
    assert _plain_types(plain) == {llama.RMSNorm, llama.QKRotary, llama.SiluAndMul, llama.RotaryEmbedding,
                                   nn.Linear}  # nn.Linear: the untied lm_head, whose weights the head packed
    assert not cpu_layers.uses_cpu_kernels(plain)

    fused = LLM(path, dtype="bfloat16", attention_backend="cpu", num_blocks=32).engine.model
    layer = fused.layers[0]
    assert isinstance(layer.input_layernorm, cpu_layers.FusedRMSNorm)
    assert isinstance(layer.self_attn.rotary, cpu_layers.FusedQKRotary)
    assert isinstance(layer.mlp.act, cpu_layers.FusedSiluAndMul)
    assert isinstance(fused.rope, cpu_layers.RopeTable) and isinstance(fused.norm, cpu_layers.FusedRMSNorm)
    assert _plain_types(fused) == {nn.Linear}
    assert cpu_layers.uses_cpu_kernels(fused)
    assert dict(fused.named_parameters()).keys() == dict(plain.named_parameters()).keys()
    rope = fused.rope
    cpu_layers.use_cpu_kernels(fused)  # a second engine on the same loaded model: nothing changes
    assert fused.rope is rope and fused.layers[0].input_layernorm is layer.input_layernorm


def test_float32_keeps_plain_projections_under_the_fused_glue(tmp_path):
    from engine.llm import LLM
    from tests.engine._tiny_llama import make_tiny_llama

    model = LLM(make_tiny_llama(str(tmp_path / "m")), dtype="float32", attention_backend="cpu",
                num_blocks=32).engine.model
    assert type(model.layers[0].self_attn.qkv_proj) is nn.Linear and type(model.output_head) is llama.OutputHead
    assert isinstance(model.layers[1].post_attention_layernorm, cpu_layers.FusedRMSNorm)

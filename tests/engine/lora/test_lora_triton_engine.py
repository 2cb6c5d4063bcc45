"""LoRA under the triton backend: the engine's adapter rows go through the gathered Triton kernel
(engine/kernels/lora.py; Triton's interpreter on CPU) and give the same greedy tokens as the torch backend's
grouped products, on the tiny random Llama of tests/engine/test_triton_engine.py, base rows and two adapters
(ranks 4 and 8, different targets) in one batch.
"""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams
from tests.engine.lora._adapters import write_adapter
from tests.engine.test_triton_engine import VOCAB, tiny_model_dir  # noqa: F401 (fixture)
from tests.engine.triton_setup import DEVICE, load_kernels, triton_mode  # noqa: F401 (fixture)

load_kernels()
pytestmark = pytest.mark.usefixtures("triton_mode")
TINY = {"layers": 2, "q_proj": (128, 256), "k_proj": (128, 64), "v_proj": (128, 64), "o_proj": (256, 128),
        "gate_proj": (128, 256), "up_proj": (128, 256), "down_proj": (256, 128)}


@pytest.mark.slow  # ~15 s in the interpreter; loadtest/gpu_check.sh runs it compiled
def test_triton_kernel_path_equals_torch_path(tiny_model_dir, tmp_path):  # noqa: F811
    loras = [LoRARequest("a", 1, write_adapter(str(tmp_path / "a"), 4, ("q_proj", "v_proj", "down_proj"),
                                               seed=1, b_std=0.5, shapes=TINY)),
             LoRARequest("b", 2, write_adapter(str(tmp_path / "b"), 8, ("k_proj", "o_proj", "gate_proj", "up_proj"),
                                               seed=2, b_std=0.5, shapes=TINY))]
    prompts = [[4, 8, 15, 16, 23, 42, 7, 9, 11], [5, 6, 7], [30, 31, 32, 33]]
    jobs = [(p, lora) for p in prompts for lora in [None, *loras]]
    out = {}
    for backend in ("torch", "triton"):
        llm = LLM(tiny_model_dir, attention_backend=backend, device=DEVICE, dtype="float32", block_size=8,
                  num_blocks=64, max_num_seqs=16, num_threads=1, enable_lora=True, max_loras=2, max_lora_rank=8)
        assert llm.engine.lora.batch.kernel == (backend == "triton")
        res = llm.generate([p for p, _ in jobs], [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                                                 lora=lora) for _, lora in jobs])
        out[backend] = [r.outputs[0].token_ids for r in res]
    assert out["triton"] == out["torch"]
    by_adapter = [out["torch"][i::3] for i in range(3)]
    assert by_adapter[0] != by_adapter[1] and by_adapter[0] != by_adapter[2]  # the adapters change the tokens

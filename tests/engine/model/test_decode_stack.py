"""A decode step's layers in one native call (engine/model/cpu_decode_stack.py): the same bits as the Python
layers, with the packed 4-bit projections (the bundled GGUF) and with oneDNN's (a checkpoint without exact 4-bit
groups); and the steps it leaves to the layers."""

from __future__ import annotations

import os
import random

import pytest
import torch

from engine.kernels import cpu_ops

if os.environ.get(cpu_ops.ENV) == "torch":
    pytest.skip("fused CPU kernels turned off", allow_module_level=True)

from engine.args import EngineArgs  # noqa: E402
from engine.attention.metadata import AttentionMetadata  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model.cpu_decode_stack import STACK_ENV, CpuDecodeStack, use_decode_stack  # noqa: E402
from engine.model.cpu_linear import OneDnnLinear, Q4Linear  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def bundled():
    from engine.model.loader import load_model
    from engine.model.registry import resolve_model

    return load_model(resolve_model("smollm2"), torch.bfloat16, "cpu", 2048)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from tests.engine._tiny_llama import make_tiny_llama

    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny") / "m"))


def _engine(model: str, loaded=None, **kw) -> LLMEngine:
    return LLMEngine(EngineArgs(model=model, dtype="bfloat16", attention_backend="cpu", **kw), model=loaded)


class Compare:
    """Runs each step twice from the same caches, through the Python layers and then as the model runs it (the
    stack where it serves the step), and records (served, same logits, same caches)."""

    def __init__(self, eng: LLMEngine):
        self.model, self.stack, self.forward = eng.model, eng.model.decode_stack, eng.model.forward
        self.results: list[tuple[bool, bool, bool]] = []
        self.rows: list[int] = []  # the largest number of rows of one sequence in each step

    def __enter__(self) -> Compare:
        self.model.forward = self
        return self

    def __exit__(self, *exc) -> None:
        del self.model.forward  # the module's own again (the loaded model is shared by the tests)

    def __call__(self, input_ids, positions, kv_caches, meta, backend, logits_indices=None):
        self.rows.append(int(meta.max_query_len))
        copies = [(k.clone(), v.clone()) for k, v in kv_caches]
        self.model.decode_stack = None
        layers = self.forward(input_ids, positions, copies, meta, backend, logits_indices)
        served = self.stack(self.model.embed_tokens(input_ids), self.model.rope(positions, torch.bfloat16),
                            [(k.clone(), v.clone()) for k, v in kv_caches], meta, backend) is not None
        self.model.decode_stack = self.stack
        stacked = self.forward(input_ids, positions, kv_caches, meta, backend, logits_indices)
        same_caches = all(torch.equal(a, c) and torch.equal(b, d)
                          for (a, b), (c, d) in zip(copies, kv_caches, strict=True))
        self.results.append((served, torch.equal(layers, stacked), same_caches))
        return stacked


def _run(eng: LLMEngine, prompts: list[list[int]], new_tokens: int) -> None:
    for i, prompt in enumerate(prompts):
        eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0))
    while eng.has_unfinished_requests():
        eng.step()


@pytest.mark.parametrize("which", ["bundled", "tiny"])
def test_steps_through_the_stack_are_the_same_bits_as_the_layers(which, tiny_path, bundled):
    eng = _engine("smollm2", bundled, num_blocks=64) if which == "bundled" else _engine(tiny_path, num_blocks=64)
    # the tiny model's random weights have no 4-bit groups; portable kernels leave the bundled one on oneDNN too
    packed = which == "bundled" and cpu_ops.ops().quant_path() != "portable"
    kind = Q4Linear if packed else OneDnnLinear
    assert type(eng.model.layers[0].self_attn.qkv_proj) is kind
    rng = random.Random(0)
    with Compare(eng) as compare:
        # one stream; then five of different lengths (one crossing a block boundary while decoding), their short
        # prompts decode rows too; then a prompt the backend attends with its prefill kernel (or SDPA)
        _run(eng, [[rng.randrange(100, 40000) for _ in range(5)]], 6)
        _run(eng, [[rng.randrange(100, 40000) for _ in range(n)] for n in (3, 6, 9, 12, 14)], 5)
        _run(eng, [[rng.randrange(100, 40000) for _ in range(300)]], 2)
    assert [served for served, _, _ in compare.results] == [True] * 6 + [True] * 5 + [False, True]
    assert all(same_logits and same_caches for _, same_logits, same_caches in compare.results)


def test_speculative_verification_steps_run_through_the_stack_with_the_same_bits(bundled):
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
    eng = _engine("smollm2", bundled, num_blocks=64, speculative_config=spec)
    eng.spec.gate = None  # every step drafts, whatever it gains here (engine/spec/draft_gate.py)
    with Compare(eng) as compare:
        _run(eng, [eng.tokenizer.encode("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,")], 12)
    assert eng.stats().spec_num_drafts > 0 and any(r > 1 for r in compare.rows)
    assert all(served for served, _, _ in compare.results)
    assert all(same_logits and same_caches for _, same_logits, same_caches in compare.results)


def test_deterministic_engines_keep_the_layers(tiny_path):
    eng = _engine(tiny_path, num_blocks=64)
    det = LLMEngine(EngineArgs(model=tiny_path, dtype="bfloat16", attention_backend="cpu", num_blocks=64,
                               deterministic=True), model=(eng.model, eng.hf_config))
    assert det.model.decode_stack is None and isinstance(eng.model.decode_stack, CpuDecodeStack)  # the view's only


def test_steps_past_a_projections_row_limit_keep_the_layers(tiny_path):
    eng = _engine(tiny_path, num_blocks=64)
    model = eng.model
    for proj in (m for m in model.modules() if isinstance(m, OneDnnLinear)):
        proj.float32_from_rows = 9  # as on Intel without AMX, at 257
    assert use_decode_stack(model) and model.decode_stack.max_rows == 8
    n = 9
    meta = AttentionMetadata(slot_mapping=torch.arange(n), query_start_loc=torch.arange(n + 1, dtype=torch.int32),
                             seq_lens=torch.ones(n, dtype=torch.int32), block_tables=torch.zeros((n, 1), dtype=torch.int32),
                             max_query_len=1, max_seq_len=1)
    h = torch.zeros(n, model.config.hidden_size, dtype=torch.bfloat16)
    rope = model.rope(torch.zeros(n, dtype=torch.long), h.dtype)
    assert model.decode_stack(h, rope, eng.runner.kv_caches, meta, eng.runner.backend) is None
    rope8 = model.rope(torch.zeros(8, dtype=torch.long), h.dtype)
    assert model.decode_stack(h[:8], rope8, eng.runner.kv_caches, _first(meta, 8), eng.runner.backend) is not None


def _first(meta: AttentionMetadata, n: int) -> AttentionMetadata:
    return AttentionMetadata(slot_mapping=meta.slot_mapping[:n], query_start_loc=meta.query_start_loc[:n + 1],
                             seq_lens=meta.seq_lens[:n], block_tables=meta.block_tables[:n], max_query_len=1,
                             max_seq_len=1)


def test_the_stack_can_be_turned_off_and_a_bad_setting_names_the_variable(tiny_path, monkeypatch):
    eng = _engine(tiny_path, num_blocks=64)
    assert isinstance(eng.model.decode_stack, CpuDecodeStack)
    monkeypatch.setenv(STACK_ENV, "off")
    assert not use_decode_stack(eng.model) and eng.model.decode_stack is None
    monkeypatch.setenv(STACK_ENV, "fast")
    with pytest.raises(ValueError, match=STACK_ENV):
        use_decode_stack(eng.model)


def test_steps_with_an_adapter_row_keep_the_layers_and_the_others_take_the_stack(tmp_path):
    from engine.lora.request import LoRARequest
    from tests.engine.lora._adapters import write_adapter

    eng = _engine("smollm2", num_blocks=64, enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=256)
    adapter = LoRARequest("a", 1, write_adapter(str(tmp_path / "a"), targets=("q_proj", "v_proj", "down_proj")))
    prompt = eng.tokenizer.encode("The capital of France is")
    with Compare(eng) as compare:
        eng.add_request("base", prompt, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
        while eng.has_unfinished_requests():
            eng.step()
        base_steps = len(compare.results)
        eng.add_request("lora", prompt, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0, lora=adapter))
        while eng.has_unfinished_requests():
            eng.step()
    assert [served for served, _, _ in compare.results] == [True] * base_steps + [False] * (len(compare.results) - base_steps)
    assert all(same_logits and same_caches for _, same_logits, same_caches in compare.results)

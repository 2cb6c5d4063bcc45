"""The offline API: LLM(...).generate / .chat on a tiny random Llama, and loader errors."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.llama import UnsupportedModelError
from engine.model.loader import load_model
from engine.model.registry import resolve_model
from tests.engine._tiny_llama import make_tiny_llama

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def llm(tiny):
    loaded = load_model(resolve_model(tiny), torch.float32, "cpu", 512)
    return LLM(tiny, loaded_model=loaded, dtype="float32", num_blocks=64, max_model_len=512, num_threads=1)


def test_generate_accepts_text_ids_and_dicts_in_order(llm):
    ids = llm.tokenizer.encode("The sky is")
    outs = llm.generate(["The sky is", ids, {"prompt_token_ids": ids}, {"prompt": "The sky is"}, "Other"], GREEDY)
    assert [o.prompt_token_ids for o in outs[:4]] == [ids] * 4
    first = outs[0].outputs[0]
    assert all(o.outputs[0].token_ids == first.token_ids for o in outs[:4])
    assert first.text == llm.tokenizer.decode(first.token_ids, skip_special_tokens=True)
    assert outs[4].prompt_token_ids == llm.tokenizer.encode("Other")
    single = llm.generate("The sky is", GREEDY)
    assert len(single) == 1 and single[0].outputs[0].token_ids == first.token_ids


def test_per_prompt_params(llm):
    outs = llm.generate(["a", "b"], [SamplingParams(max_tokens=2, ignore_eos=True),
                                     SamplingParams(max_tokens=5, ignore_eos=True)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


def test_chat_uses_the_template(llm):
    msgs = [{"role": "user", "content": "hi"}]
    one = llm.chat(msgs, GREEDY)
    assert one[0].prompt_token_ids == llm.tokenizer.apply_chat_template(msgs)
    two = llm.chat([msgs, [{"role": "user", "content": "yo"}]], GREEDY)
    assert len(two) == 2 and two[0].outputs[0].token_ids == one[0].outputs[0].token_ids


def test_bad_inputs_are_clear_errors(llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["a"], [GREEDY, GREEDY])
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        llm.generate(["a", 3.5], GREEDY)
    with pytest.raises(ValueError, match=r"prompts\[0\] must have 'prompt'"):
        llm.generate([{"text": "a"}], GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_kv_cache_size_is_logged(tiny, caplog):
    loaded = load_model(resolve_model(tiny), torch.float32, "cpu", 512)
    with caplog.at_level(logging.INFO, logger="engine.model_runner"):
        LLM(tiny, loaded_model=loaded, dtype="float32", kv_cache_memory=0.001, max_model_len=512, num_threads=1)
    per_token = 2 * 2 * 2 * 16 * 4  # layers x K/V x kv_heads x head_dim x fp32
    blocks = int(0.001 * (1 << 30)) // (per_token * 16)
    assert f"KV cache: {blocks} blocks x 16 tokens = {blocks * 16} tokens" in caplog.text


def test_loader_errors_name_the_problem(tmp_path, tiny):
    bad = tmp_path / "gpt2"
    bad.mkdir()
    cfg = json.loads(open(f"{tiny}/config.json").read())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    (bad / "model.safetensors").write_bytes(open(f"{tiny}/model.safetensors", "rb").read())
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2' is not supported"):
        load_model(resolve_model(str(bad)), torch.float32)
    from safetensors.torch import load_file, save_file

    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text(open(f"{tiny}/config.json").read())
    state = load_file(f"{tiny}/model.safetensors")
    state.pop("model.layers.1.mlp.up_proj.weight")
    save_file(state, str(partial / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="missing 1 tensors"):
        load_model(resolve_model(str(partial)), torch.float32)

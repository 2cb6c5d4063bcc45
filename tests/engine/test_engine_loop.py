"""The engine loop on a tiny random Llama: HF equality of the decoder (RoPE variants, GQA, untied head,
qkv bias), n > 1 block sharing, seeded sampling across runs and batch compositions, stops, aborts, and
the KV cache sizing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import SamplingParams
from engine.llm import LLM
from engine.model.loader import load_model, resolve_dtype
from engine.model.registry import resolve_model
from engine.model_runner import kv_bytes_per_token, num_blocks_for_memory
from engine.output_text import RequestText
from engine.sequence import SequenceStatus
from tests.engine._tiny_llama import make_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def tiny_loaded(tiny):
    return load_model(resolve_model(tiny), torch.float32, "cpu", 1024)


def _llm(tiny, tiny_loaded, **kw) -> LLM:
    args = dict(dtype="float32", num_blocks=128, max_num_seqs=16, max_model_len=1024, seed=0, num_threads=1)
    args.update(kw)
    return LLM(tiny, loaded_model=tiny_loaded, **args)


def _hf_greedy(path: str, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=2)
    return out[0, len(prompt):].tolist()


PROMPT = [(i * 7919) % 40000 + 3 for i in range(37)]  # 37 tokens: 2 full blocks + a partial one


@pytest.mark.parametrize("overrides", [
    {},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}},
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}},
    {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    {"tie_word_embeddings": True, "num_key_value_heads": 1, "attention_bias": True},
], ids=["default", "llama3", "linear", "yarn", "dynamic", "tied-mqa-bias"])
def test_decoder_matches_hf_greedy(tmp_path, overrides):
    path = make_tiny_llama(str(tmp_path / "m"), seed=1, **overrides)
    llm = LLM(path, dtype="float32", num_blocks=32, max_num_seqs=4, max_model_len=1024, num_threads=1)
    ours = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert ours.outputs[0].token_ids == _hf_greedy(path, PROMPT, 12)


def test_n4_allocates_prompt_blocks_once(tiny, tiny_loaded):
    llm = _llm(tiny, tiny_loaded, enable_prefix_caching=False)
    eng = llm.engine
    eng.add_request("r", PROMPT, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True))
    eng.step()  # prefill, fork, first token of each of the 4 completions
    seqs = eng.requests["r"].seqs
    assert len(seqs) == 4
    assert eng.kv.stats().num_used_blocks == 3  # ceil(37 / 16): the prompt's blocks, once
    assert all(s.block_table == seqs[0].block_table for s in seqs)
    eng.step()  # each completion writes its 38th token into the shared partial block: copy-on-write
    tables = [s.block_table for s in seqs]
    assert all(t[:2] == tables[0][:2] for t in tables)  # the 2 full prompt blocks stay shared
    assert len({t[2] for t in tables}) == 4
    assert eng.kv.stats().num_used_blocks == 2 + 4
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.kv.stats().num_used_blocks == 0


def test_n4_outputs_have_every_index_and_differ(tiny, tiny_loaded):
    llm = _llm(tiny, tiny_loaded)
    out = llm.generate([PROMPT], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_seeded_sampling_is_reproducible_across_runs_and_batches(tiny, tiny_loaded):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    alone = _llm(tiny, tiny_loaded).generate([PROMPT], seeded)[0].outputs[0].token_ids
    again = _llm(tiny, tiny_loaded).generate([PROMPT], seeded)[0].outputs[0].token_ids
    fillers = [[5 + i, 17, 99, 1000 + i] * (i + 1) for i in range(5)]
    mixed = _llm(tiny, tiny_loaded).generate(fillers[:2] + [PROMPT] + fillers[2:], [other] * 2 + [seeded] + [other] * 3)
    small_budget = _llm(tiny, tiny_loaded, max_num_batched_tokens=16, max_num_seqs=4).generate(
        [PROMPT] + fillers, [seeded] + [other] * 5)
    assert alone == again == mixed[2].outputs[0].token_ids == small_budget[0].outputs[0].token_ids
    unseeded = SamplingParams(temperature=0.9, max_tokens=16, ignore_eos=True)
    runs = {tuple(_llm(tiny, tiny_loaded, seed=s).generate([PROMPT], unseeded)[0].outputs[0].token_ids)
            for s in (1, 2)}
    assert len(runs) == 2  # without a request seed, the engine seed decides


def test_stop_strings_max_tokens_and_stop_token_ids(tiny, tiny_loaded):
    llm = _llm(tiny, tiny_loaded)
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    text = greedy.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))[0]
    comp = out.outputs[0]
    assert comp.finish_reason == "stop" and comp.stop_reason == stop
    assert stop not in comp.text and text.startswith(comp.text)
    tok = greedy.token_ids[4]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[tok]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == tok and out.token_ids[-1] == tok
    assert len(out.token_ids) == greedy.token_ids.index(tok) + 1


def test_abort_frees_blocks_and_reports_abort(tiny, tiny_loaded):
    llm = _llm(tiny, tiny_loaded)
    eng = llm.engine
    eng.add_request("a", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    eng.add_request("b", PROMPT[:5], SamplingParams(max_tokens=3, ignore_eos=True))
    made = [t for _ in range(2) for d in eng.step() if d.request_id == "a" for t in d.outputs[0].token_ids]
    out = eng.abort_request("a")
    assert len(made) == 2 and out.finished and out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == []
    assert eng.abort_request("a") is None
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.kv.stats().num_used_blocks == 0


def test_bad_requests_raise_before_running(tiny, tiny_loaded):
    from engine.errors import RequestTooLongError
    from engine.sampling_params import SamplingParamsError

    eng = _llm(tiny, tiny_loaded, num_blocks=8, max_model_len=512).engine
    with pytest.raises(RequestTooLongError, match="maximum context length is 512 tokens"):
        eng.add_request("x", [5] * 500, SamplingParams(max_tokens=100))
    with pytest.raises(RequestTooLongError, match="KV cache holds only 8 blocks"):
        eng.add_request("x", [5] * 200, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request("x", [5, 10**6], SamplingParams())
    with pytest.raises(SamplingParamsError) as e:
        eng.add_request("x", [5], SamplingParams(logit_bias={10**6: 1.0}))
    assert e.value.param == "logit_bias"
    with pytest.raises(ValueError, match="at least one token"):
        eng.add_request("x", [], SamplingParams())
    assert not eng.has_unfinished_requests()


def test_finished_sequences_carry_status(tiny, tiny_loaded):
    eng = _llm(tiny, tiny_loaded).engine
    eng.add_request("r", PROMPT, SamplingParams(max_tokens=2, ignore_eos=True))
    seq = eng.requests["r"].seqs[0]
    while eng.has_unfinished_requests():
        eng.step()
    assert seq.status is SequenceStatus.FINISHED_LENGTH and seq.block_table == []


def test_kv_cache_sizing_formula(tiny_loaded):
    model, _ = tiny_loaded
    cfg = model.config
    assert kv_bytes_per_token(cfg, torch.float32) == cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    per_block = kv_bytes_per_token(cfg, torch.bfloat16) * 16
    assert num_blocks_for_memory(cfg, torch.bfloat16, 16, 1.0) == (1 << 30) // per_block


def test_dtype_auto_follows_cpu_flags(monkeypatch):
    from engine.model import loader

    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", "cpu") is torch.bfloat16
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", "cpu") is torch.float32
    assert resolve_dtype("float16", "cpu") is torch.float16
    with pytest.raises(ValueError, match="--dtype"):
        resolve_dtype("int8", "cpu")


def test_steps_yield_only_what_is_new(tiny, tiny_loaded):
    """Each step's delta holds one new token per running completion (its logprob) and a finish reason once;
    concatenated, and their text made as the front ends make it, they are the whole completion the offline
    LLM returns. The second run reads the prompt from the prefix cache: its logprobs equal the first's bit for bit
    only under --deterministic (default mode promises the tokens, not the digits of logprobs)."""
    llm = _llm(tiny, tiny_loaded, deterministic=True)
    params = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=10, ignore_eos=True, logprobs=2)
    whole = llm.generate([PROMPT], params)[0]
    eng = llm.engine
    eng.add_request("d", PROMPT, params)
    deltas = []
    while eng.has_unfinished_requests():
        deltas += eng.step()
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert all(o.text == "" for d in deltas for o in d.outputs)  # the core deals in tokens
    text = RequestText(params, PROMPT, llm.tokenizer)
    shown = [text.apply(d)[0] for d in deltas]
    for d in deltas:
        assert all(len(o.token_ids) == 1 and [lp.token_id for lp in o.logprobs] == o.token_ids for o in d.outputs)
        assert d.num_prompt_tokens == len(PROMPT)
    for c in whole.outputs:
        mine = [o for d in deltas for o in d.outputs if o.index == c.index]
        assert [t for o in mine for t in o.token_ids] == c.token_ids and len(c.token_ids) == 10
        assert "".join(o.text for d in shown for o in d.outputs if o.index == c.index) == c.text
        assert [lp.logprob for o in mine for lp in o.logprobs] == [lp.logprob for lp in c.logprobs]
        assert [o.finish_reason for o in mine] == [None] * 9 + ["length"]


def test_a_stop_string_across_tokens_ends_the_completion_at_the_string(tiny, tiny_loaded):
    """The front end finds the string and stops the completion in the core: nothing is left running or held."""
    llm = _llm(tiny, tiny_loaded)
    free = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    stop = free.text[3:7]
    eng = llm.engine
    for keep in (False, True):
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop],
                                                    include_stop_str_in_output=keep))[0].outputs[0]
        cut = free.text.index(stop) + (len(stop) if keep else 0)
        assert out.text == free.text[:cut] and (out.finish_reason, out.stop_reason) == ("stop", stop)
        assert out.token_ids == free.token_ids[:len(out.token_ids)] and len(out.token_ids) < 12
        assert not eng.has_unfinished_requests() and eng.kv.num_free_blocks == eng.kv.num_blocks


def test_one_completion_of_several_stopped_by_a_string_leaves_the_others_running(tiny, tiny_loaded):
    llm = _llm(tiny, tiny_loaded)
    sampled = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=12, ignore_eos=True)
    free = llm.generate([PROMPT], sampled)[0].outputs
    stop = free[1].text[2:5]  # completion 1 holds it; the others may or may not
    outs = llm.generate([PROMPT], dataclasses.replace(sampled, stop=[stop]))[0].outputs
    assert {o.finish_reason for o in outs} == {"stop", "length"}  # (seed 4: completions 0 and 2 lack the string)
    for got, want in zip(outs, free, strict=True):
        if stop in want.text:
            assert (got.finish_reason, got.stop_reason) == ("stop", stop)
            assert got.text == want.text[:want.text.index(stop)]
        else:
            assert got.finish_reason == "length" and got.text == want.text and len(got.token_ids) == 12
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
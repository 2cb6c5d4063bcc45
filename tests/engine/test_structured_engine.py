"""Constrained decoding in the engine with the bundled SmolLM2: answers follow their schema (sampled at
temperature 1.0), and constrained rows in a batch leave the unconstrained rows' tokens exactly as they
were without them (greedy)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine.errors import InvalidRequestError
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.structured.spec import Guide
from tests.engine.schemas_for_tests import random_schema

pytestmark = pytest.mark.model

PROMPTS = ["The capital of France is", "List three colours:", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2", dtype="float32", num_blocks=512, max_num_seqs=16, max_model_len=2048, num_threads=2)


def _chat(llm, text):
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def test_mixed_batch_leaves_unconstrained_tokens_unchanged(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    alone = llm.generate(PROMPTS, greedy)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    constrained = [SamplingParams(temperature=0.0, max_tokens=24, guide=Guide.json_schema(schema)),
                   SamplingParams(temperature=1.0, seed=3, max_tokens=24, guide=Guide.regex(r"[0-9]{1,8}"))]
    mixed = llm.generate(PROMPTS[:2] + [_chat(llm, "a number")] * 2 + PROMPTS[2:],
                         [greedy, greedy, *constrained, greedy, greedy])
    got = [mixed[i] for i in (0, 1, 4, 5)]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in alone]
    assert json.loads(mixed[2].outputs[0].text)["a"] is not None
    assert re.fullmatch(r"[0-9]{1,8}", mixed[3].outputs[0].text)


def test_schemas_hold_at_temperature_one(llm):
    schemas = [random_schema(s) for s in range(8)]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=200, guide=Guide.json_schema(sc))
              for s, sc in enumerate(schemas)]
    outs = llm.generate([_chat(llm, "Answer in JSON.")] * len(schemas), params)
    for sc, out in zip(schemas, outs, strict=True):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), sc)


def test_choice_json_object_and_n_greater_than_one(llm):
    outs = llm.generate([_chat(llm, "Yes or no?"), _chat(llm, "JSON please")], [
        SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=8, guide=Guide.choice(["yes", "no", "maybe so"])),
        SamplingParams(temperature=0.0, max_tokens=120, guide=Guide.json_object())])
    assert {c.text for c in outs[0].outputs} <= {"yes", "no", "maybe so"} and len(outs[0].outputs) == 3
    assert isinstance(json.loads(outs[1].outputs[0].text), dict)


@pytest.mark.parametrize("guide, param", [
    (Guide.json_schema({"type": "nonsense"}), "response_format.json_schema.schema"),
    (Guide.json_schema({"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}}}),
     "response_format.json_schema.schema"),
    (Guide.regex("a(b"), "guided_regex"),
    (Guide.grammar("root ::= missing_rule"), "guided_grammar"),
])
def test_a_guide_that_cannot_compile_is_refused_naming_its_field(llm, guide, param):
    with pytest.raises(InvalidRequestError) as e:
        llm.generate("x", SamplingParams(max_tokens=4, guide=guide))
    assert e.value.param == param
    assert not llm.engine.has_unfinished_requests()

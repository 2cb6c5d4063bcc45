"""engine/structured/grammars.py and bitmask.py with the bundled tokenizer: compiled once per guide, failures
cached yet naming each asker's field; the mask touches only constrained rows and never the raw logits."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.structured.bitmask import GrammarMasks, mask_constrained_rows
from engine.structured.grammars import GrammarCache
from engine.structured.spec import Guide
from engine.tokenizer import load_tokenizer

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2")


@pytest.fixture()
def cache(tok):
    c = GrammarCache(lambda: tok.hf, tok.vocab_size, tok.eos_token_ids)
    yield c
    c.close()


def test_compiled_once_per_guide(cache):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    g1, g2 = Guide.json_schema(schema), Guide.json_schema(json.loads(json.dumps(schema)), "tools[0].function.parameters")
    first = cache.compile(g1)
    assert cache.compile(g2) is first and asyncio.run(cache.compile_async(g1)) is first
    assert (cache.misses, cache.hits) == (1, 2)
    cache.compile(Guide.regex("[0-9]+"))
    assert cache.misses == 2


def test_a_cached_failure_names_each_askers_field(cache):
    bad = {"type": "string", "pattern": "(?<=a)b"}
    with pytest.raises(InvalidRequestError) as e1:
        cache.compile(Guide.json_schema(bad, "response_format.json_schema.schema"))
    with pytest.raises(InvalidRequestError) as e2:
        asyncio.run(cache.compile_async(Guide.json_schema(bad, "tools[3].function.parameters")))
    assert e1.value.param == "response_format.json_schema.schema" and str(e1.value).startswith(e1.value.param)
    assert e2.value.param == "tools[3].function.parameters" and str(e2.value).startswith(e2.value.param)
    assert "Lookbehind" in str(e2.value) and "[" not in str(e2.value).split(":")[1][:3]
    assert cache.misses == 1


def test_mask_touches_only_constrained_rows(cache, tok):
    free = Sequence("a", [1, 2], SamplingParams())
    guided = Sequence("b", [1, 2], SamplingParams(guide=Guide.choice(["yes", "no"])))
    guided.matcher = cache.matcher(guided.params.guide)
    logits = torch.randn(3, tok.vocab_size)
    raw = logits.clone()
    x = mask_constrained_rows(logits, logits, [free, guided, free], GrammarMasks())
    assert torch.equal(logits, raw)  # the raw logits (logprobs read them) are not modified
    assert torch.equal(x[0], raw[0]) and torch.equal(x[2], raw[2])
    allowed = torch.isfinite(x[1]).nonzero().flatten().tolist()
    assert allowed and all(tok.decode([t]) in ("y", "ye", "yes", "n", "no") for t in allowed)
    assert mask_constrained_rows(logits, logits, [free, free], GrammarMasks()) is logits  # nothing to do: no copy

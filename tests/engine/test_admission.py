"""engine/admission.py: every check a request meets before it is queued, with the field it blames."""

from __future__ import annotations

import pytest

from engine.admission import EngineLimits, admit
from engine.errors import InvalidRequestError, RequestTooLongError
from engine.sampling_params import SamplingParams, SamplingParamsError

LIMITS = EngineLimits(vocab_size=49152, max_model_len=64, max_num_seqs=4, block_size=4, num_blocks=8)


def _refused(prompt, params, limits=LIMITS) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as e:
        admit(prompt, params, limits)
    return e.value


def test_a_request_that_fits_comes_back_as_ints_and_unchanged_params():
    params = SamplingParams(max_tokens=3)
    prompt, out = admit((1, 2, 3), params, LIMITS)
    assert prompt == [1, 2, 3] and out is params


def test_no_max_tokens_resolves_to_what_is_left_of_context_and_cache():
    # 32 slots in the cache; the last sampled token needs none: 30 prompt tokens leave 3 outputs
    assert admit([1] * 30, SamplingParams(max_tokens=None), LIMITS)[1].max_tokens == 3
    roomy = EngineLimits(49152, 64, 4, 16, 100)
    assert admit([1] * 60, SamplingParams(max_tokens=None), roomy)[1].max_tokens == 4  # context-bound


def test_too_long_requests_name_the_field_and_the_limit():
    e = _refused([1] * 60, SamplingParams(max_tokens=5))
    assert isinstance(e, RequestTooLongError) and e.param == "max_tokens" and e.code == "context_length_exceeded"
    assert "maximum context length is 64 tokens" in str(e) and "you requested 65 tokens" in str(e)
    e = _refused([1] * 30, SamplingParams(max_tokens=11))
    assert e.param == "max_tokens" and "needs up to 40 KV slots (10 blocks of 4)" in str(e)
    assert "holds only 8 blocks" in str(e)
    e = _refused([1] * 64, SamplingParams(max_tokens=None))
    assert e.param == "prompt" and "no room for output" in str(e)
    e = _refused([1] * 40, SamplingParams(max_tokens=None))  # fits the context, not the cache
    assert e.param == "prompt" and isinstance(e, RequestTooLongError)
    assert admit([1] * 30, SamplingParams(max_tokens=3), LIMITS)[1].max_tokens == 3  # 32 slots: exactly


def test_bad_prompts_and_params_are_refused_with_their_field():
    assert _refused([], SamplingParams()).param == "prompt"
    e = _refused([5, 49152], SamplingParams())
    assert e.param == "prompt" and "49152 is outside the vocabulary" in str(e)
    e = _refused([5], SamplingParams(logit_bias={70000: 1.0}))
    assert isinstance(e, SamplingParamsError) and e.param == "logit_bias" and "70000" in str(e)
    assert _refused([5], SamplingParams(stop_token_ids=[49152])).param == "stop_token_ids"
    e = _refused([5], SamplingParams(n=5, max_tokens=1))
    assert e.param == "n" and "max_num_seqs (4)" in str(e)
    admit([5], SamplingParams(logit_bias={49151: 1.0}, stop_token_ids=[0], max_tokens=1), LIMITS)

"""Which requests may move, and the request that continues one choice, exactly."""

from __future__ import annotations

import json

from contract.request import Endpoint, parse_request
from router.migration.continuation import continuation_body, top_logprobs, why_not


def req(endpoint: Endpoint, **body):
    return parse_request(endpoint, json.dumps(body).encode())


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def test_a_chat_choice_goes_on_as_a_token_prompt_with_what_is_left():
    r = req(Endpoint.CHAT, **CHAT, max_completion_tokens=10, temperature=0, stop=["\n"], logprobs=True,
            top_logprobs=2, min_tokens=5, n=2, seed=3, stream_options={"include_usage": True}).with_fields(
        return_token_ids=True, priority=-1)
    assert continuation_body(r, [1, 2, 3], [7, 8]) == {
        "model": "m", "prompt": [1, 2, 3, 7, 8], "max_tokens": 8, "min_tokens": 3, "temperature": 0,
        "stop": ["\n"], "seed": 3, "priority": -1, "logprobs": 2, "n": 1, "stream": True, "return_token_ids": True}


def test_no_limit_stays_no_limit_and_completions_logprobs_stay():
    r = req(Endpoint.CHAT, **CHAT)
    assert continuation_body(r, [1], [2])["max_tokens"] is None
    c = req(Endpoint.COMPLETIONS, model="m", prompt="x", stream=True, logprobs=1, ignore_eos=True)
    body = continuation_body(c, [1], [2, 3])
    assert body["max_tokens"] == 14 and body["logprobs"] == 1 and body["ignore_eos"] is True  # 16 by default
    assert top_logprobs(req(Endpoint.CHAT, **CHAT, logprobs=True)) == 0
    assert top_logprobs(req(Endpoint.CHAT, **CHAT)) is None


def test_what_cannot_move():
    assert why_not(req(Endpoint.CHAT, **CHAT)) is None
    assert why_not(req(Endpoint.CHAT, **{**CHAT, "stream": False})) == "not streamed"
    assert why_not(req(Endpoint.CHAT, **CHAT, tools=[{"type": "function", "function": {"name": "f"}}])) == "tools"
    assert why_not(req(Endpoint.CHAT, **CHAT, response_format={"type": "json_object"})) == "response_format"
    assert why_not(req(Endpoint.CHAT, **CHAT, response_format={"type": "text"})) is None
    assert why_not(req(Endpoint.CHAT, **CHAT, guided_regex="a+")) == "constrained decoding"
    assert why_not(req(Endpoint.COMPLETIONS, prompt="a", stream=True, echo=True)) == "echo"
    assert why_not(req(Endpoint.COMPLETIONS, prompt=["a", "b"], stream=True)) == "a batch of prompts"
    assert why_not(req(Endpoint.COMPLETIONS, prompt=[1, 2], stream=True)) is None

"""The typed OpenAI request (contract/request.py): one max_tokens rule for every spelling, errors that name the
field (the same field the engine's own validation names), and an upstream body written once."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from contract.request import Endpoint, RequestError, lone_surrogate_path, parse_request
from engine.server.errors import validation_message
from engine.server.protocol import ChatCompletionRequest, CompletionRequest

MSGS = [{"role": "user", "content": "hi"}]


def chat(**fields) -> bytes:
    return json.dumps({"messages": MSGS, **fields}).encode()


@pytest.mark.parametrize("fields, expected, field", [
    ({}, None, None),
    ({"max_tokens": None}, None, None),
    ({"max_completion_tokens": None}, None, None),
    ({"max_tokens": 60}, 60, "max_tokens"),
    ({"max_completion_tokens": 7}, 7, "max_completion_tokens"),
    ({"max_completion_tokens": None, "max_tokens": 60}, 60, "max_tokens"),  # bug 1's spelling
    ({"max_completion_tokens": 5, "max_tokens": 60}, 5, "max_completion_tokens"),
])
def test_one_max_tokens_rule_for_every_spelling(fields, expected, field):
    req = parse_request(Endpoint.CHAT, chat(**fields))
    assert req.max_tokens == expected and req.max_tokens_field == field
    engine = ChatCompletionRequest.model_validate(json.loads(chat(**fields)))
    assert engine.requested_max_tokens() == expected  # the engine reads it by the same rule


def test_completions_limit_is_openais_default_16():
    req = parse_request(Endpoint.COMPLETIONS, b'{"prompt": "a"}')
    assert req.max_tokens is None and req.limit == 16
    assert CompletionRequest.model_validate({"prompt": "a"}).max_tokens == 16
    assert parse_request(Endpoint.CHAT, chat()).limit is None


@pytest.mark.parametrize("fields", [
    {"max_completion_tokens": None, "max_tokens": 60}, {"max_completion_tokens": 60, "max_tokens": 70},
    {"max_tokens": 60}, {"max_completion_tokens": 60}, {}, {"max_tokens": None}])
def test_with_max_tokens_leaves_exactly_one_field_upstream(fields):
    req = parse_request(Endpoint.CHAT, chat(**fields)).with_max_tokens(8)
    body = json.loads(req.upstream_body())
    values = [body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
    assert values == [8] and req.max_tokens == 8
    # whatever rule an engine uses (ours, or "max_tokens first"), it reads 8
    assert ChatCompletionRequest.model_validate(body).requested_max_tokens() == 8
    assert body.get("max_tokens", body.get("max_completion_tokens")) == 8


def test_upstream_body_is_the_clients_bytes_until_something_changes():
    raw = chat(temperature=0, user="u1")
    req = parse_request(Endpoint.CHAT, raw)
    assert req.upstream_body() is raw
    changed = req.with_fields(cache_salt="s1")
    assert json.loads(changed.upstream_body()) == {**json.loads(raw), "cache_salt": "s1"}
    assert changed.cache_salt == "s1" and req.cache_salt is None  # a new request; the first is unchanged
    assert req.upstream_body() is raw


def test_lone_surrogate_is_a_400_naming_the_string():
    with pytest.raises(RequestError) as e:
        parse_request(Endpoint.CHAT, b'{"messages": [{"role": "user", "content": "\\ud800x"}]}')
    assert e.value.status == 400 and e.value.param == "messages[0].content"
    # a proper pair is fine
    req = parse_request(Endpoint.CHAT, b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}')
    assert req.body["messages"][0]["content"] == "\U0001F600"
    with pytest.raises(RequestError) as e:
        parse_request(Endpoint.COMPLETIONS, b'{"prompt": ["ok", "\\udc00"]}')
    assert e.value.param == "prompt[1]"


def test_deep_nesting_is_a_400():
    with pytest.raises(RequestError) as e:
        parse_request(Endpoint.CHAT, b"[" * 50_000 + b"]" * 50_000)
    assert e.value.status == 400 and "nested too deeply" in str(e.value)
    with pytest.raises(RequestError) as e:
        parse_request(Endpoint.CHAT, b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")
    assert e.value.status == 400


@pytest.mark.parametrize("endpoint, body", [
    (Endpoint.CHAT, {"messages": MSGS, "max_tokens": "5"}),
    (Endpoint.CHAT, {"messages": MSGS, "max_tokens": 0}),
    (Endpoint.CHAT, {"messages": MSGS, "max_completion_tokens": True}),
    (Endpoint.CHAT, {"messages": MSGS, "n": 0}),
    (Endpoint.CHAT, {"messages": MSGS, "n": 129}),
    (Endpoint.CHAT, {"messages": MSGS, "stream": "yes"}),
    (Endpoint.CHAT, {"messages": MSGS, "cache_salt": ""}),
    (Endpoint.CHAT, {"messages": MSGS, "cache_salt": 5}),
    (Endpoint.CHAT, {"messages": MSGS, "model": 3}),
    (Endpoint.CHAT, {"messages": MSGS, "user": ["u"]}),
    (Endpoint.CHAT, {"messages": MSGS, "prompt_cache_key": ""}),
    (Endpoint.CHAT, {"messages": MSGS, "prompt_cache_key": 7}),
    (Endpoint.CHAT, {"messages": MSGS, "prompt_cache_key": "k" * 1025}),
    (Endpoint.CHAT, {"messages": MSGS, "prompt_cache_retention": "forever"}),
    (Endpoint.COMPLETIONS, {"prompt": "a", "prompt_cache_retention": 24}),
    (Endpoint.CHAT, {"messages": []}),
    (Endpoint.CHAT, {"messages": "hi"}),
    (Endpoint.CHAT, {}),
    (Endpoint.COMPLETIONS, {}),
    (Endpoint.COMPLETIONS, {"prompt": 5}),
    (Endpoint.COMPLETIONS, {"prompt": "a", "max_tokens": -1}),
])
def test_router_refuses_what_the_engine_refuses_naming_the_same_field(endpoint, body):
    with pytest.raises(RequestError) as router_error:
        parse_request(endpoint, json.dumps(body).encode())
    model = ChatCompletionRequest if endpoint is Endpoint.CHAT else CompletionRequest
    with pytest.raises(ValidationError) as engine_error:
        model.model_validate(body)
    _, engine_param = validation_message(engine_error.value.errors())
    assert router_error.value.status == 400
    assert router_error.value.param == engine_param


@pytest.mark.parametrize("raw, message", [(b"{", "not valid JSON"), (b"[1]", "JSON object"),
                                          (b"\xff\xfe", "not valid JSON")])
def test_bodies_that_are_no_json_object(raw, message):
    with pytest.raises(RequestError) as e:
        parse_request(Endpoint.CHAT, raw)
    assert message in str(e.value) and e.value.param is None


def test_the_surrogate_walk_needs_no_recursion():
    """The engine walks every request's messages: a body nested as deep as JSON allows must be a 400 from
    its validation, never a RecursionError (a 500) inside it."""
    deep: list = ["x\ud800"]
    for _ in range(100_000):
        deep = [deep]
    assert lone_surrogate_path(deep, "messages") == "messages" + "[0]" * 100_001
    clean: list = []
    for _ in range(100_000):
        clean = [clean]
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"messages": [clean]})
    assert validation_message(e.value.errors())[1] == "messages[0]"  # a 400 naming the field


def test_prompt_cache_fields_are_read_and_go_upstream_untouched():
    raw = json.dumps({"messages": MSGS, "prompt_cache_key": "docs-v2", "prompt_cache_retention": "24h"}).encode()
    req = parse_request(Endpoint.CHAT, raw)
    assert req.prompt_cache_key == "docs-v2" and req.upstream_body() == raw
    assert parse_request(Endpoint.CHAT, json.dumps({"messages": MSGS}).encode()).prompt_cache_key is None

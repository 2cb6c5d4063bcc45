"""cache_control on /v1/chat/completions: the marked prefix measured on the real chat template, pinned through a
flood that evicts everything else, Anthropic's usage fields, the 400 for a bad value and the 429 beyond a limit.

The engine runs with 64 KV blocks of 16 tokens: 16 may be pinned (--kv-pin-fraction 0.25), 8 per tenant
(--kv-pin-tenant-fraction 0.125), and the other 48 are what a flood of distinct prompts churns through.
"""

from __future__ import annotations

import json
import signal

import httpx
import pytest

from contract.fairness import FAIRNESS_HEADER
from contract.messages import chat_messages
from engine.server.prompt_cache import cache_pin, common_prefix, marks
from engine.server.protocol import ChatCompletionRequest
from engine.tokenizer import load_tokenizer
from tests.engine.server.conftest import start_engine

EPH = {"type": "ephemeral"}
DOCS = "Reference manual. " + " ".join(f"Rule {i}: valves open clockwise." for i in range(14))  # ~100 tokens


def chat(system: str, question: str, mark: bool = True, **extra) -> dict:
    part = {"type": "text", "text": system, **({"cache_control": EPH} if mark else {})}
    return {"model": "smollm2", "messages": [{"role": "system", "content": [part]},
                                             {"role": "user", "content": question}],
            "max_tokens": 2, "temperature": 0, **extra}


def test_the_marked_prefix_ends_where_the_marked_part_ends():
    tok = load_tokenizer("smollm2")
    body = chat(DOCS, "Which way do valves open?")
    req = ChatCompletionRequest.model_validate(body)
    messages = chat_messages([m.model_dump(exclude_none=True) for m in req.messages])
    prompt = tok.apply_chat_template(messages, True)
    pin = cache_pin(tok, req, messages, None, prompt)
    system_only = tok.apply_chat_template(messages[:1], False)
    assert pin is not None and pin.ttl_s == 300.0
    assert pin.num_tokens == common_prefix(system_only, prompt)
    assert len(system_only) - 3 <= pin.num_tokens <= len(system_only)  # up to the template's closing of the cut
    assert 90 < pin.num_tokens < len(prompt)
    two = ChatCompletionRequest.model_validate({**body, "messages": [
        body["messages"][0], {"role": "user", "content": "q", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]})
    assert [m.message for m in marks(two)] == [0, 1]
    longer = cache_pin(tok, two, chat_messages([m.model_dump(exclude_none=True) for m in two.messages]), None,
                       tok.apply_chat_template(chat_messages([m.model_dump(exclude_none=True) for m in two.messages])))
    assert longer is not None and longer.num_tokens > pin.num_tokens and longer.ttl_s == 3600.0


def test_a_marked_tool_pins_the_prompt_up_to_that_tool():
    tok = load_tokenizer("smollm2")
    tools = [{"type": "function", "function": {"name": f"tool_{k}", "description": "Looks things up. " * 8,
                                               "parameters": {"type": "object"}}} for k in range(3)]
    body = {**chat(DOCS, "q", mark=False), "tools": [tools[0], {**tools[1], "cache_control": EPH}, tools[2]]}
    req = ChatCompletionRequest.model_validate(body)
    messages = chat_messages([m.model_dump(exclude_none=True) for m in req.messages])
    prompt = tok.apply_chat_template(messages, True, tools)
    pin = cache_pin(tok, req, messages, tools, prompt)
    upto = common_prefix(tok.apply_chat_template(messages[:1], False, tools[:2]), prompt)
    assert pin is not None and pin.num_tokens == upto
    first_only = common_prefix(tok.apply_chat_template(messages[:1], False, tools[:1]), prompt)
    assert first_only < pin.num_tokens < len(prompt)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    server = start_engine(str(tmp_path_factory.mktemp("pins")), "--num-blocks", "64", "--max-model-len", "512",
                          "--max-num-seqs", "4", "--dtype", "float32", "--kv-pin-fraction", "0.25",
                          "--kv-pin-tenant-fraction", "0.125")
    yield server
    server.stop(signal.SIGTERM)


def post(engine, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{engine.url}/v1/chat/completions", json=body, headers=headers or {}, timeout=120)


def flood(engine, rounds: int) -> None:
    """Distinct ~200-token prompts (13 blocks each): more than the 48 unpinned blocks, so every unpinned prefix
    is evicted."""
    for k in range(rounds):
        text = " ".join(f"flood{k} item {i} of many." for i in range(40))
        assert post(engine, chat(text, "ok?", mark=False)).status_code == 200


def test_a_pinned_prefix_survives_a_flood_and_usage_says_so(engine):
    first = post(engine, chat(DOCS, "Which way do valves open?"))
    assert first.status_code == 200, first.text
    usage = first.json()["usage"]
    created = usage["cache_creation_input_tokens"]
    assert 90 < created < usage["prompt_tokens"] and usage["cache_read_input_tokens"] == 0
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    pinned = created // 16
    assert engine.metric("kvfleet:kv_pinned_blocks") == pinned
    unpinned_docs = DOCS.replace("valves", "pipes")
    assert post(engine, chat(unpinned_docs, "q", mark=False)).status_code == 200
    flood(engine, 6)
    again = post(engine, chat(DOCS, "And pipes?")).json()["usage"]
    assert again["cache_read_input_tokens"] == pinned * 16 == again["prompt_tokens_details"]["cached_tokens"]
    assert again["prompt_tokens_details"]["cached_tokens_by_tier"] == {"device": pinned * 16, "lower_tier": 0,
                                                                       "peer": 0}
    assert again["cache_creation_input_tokens"] == created - pinned * 16
    plain = post(engine, chat(unpinned_docs, "q2", mark=False)).json()["usage"]
    assert plain["prompt_tokens_details"]["cached_tokens"] == 0  # the same flood evicted the unpinned prefix
    assert "cache_creation_input_tokens" not in plain
    assert engine.metric("kvfleet:kv_pinned_blocks") == pinned


def test_the_streaming_usage_chunk_carries_the_cache_fields(engine):
    body = chat(DOCS, "Stream it.", stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", f"{engine.url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    usage = chunks[-1]["usage"]
    assert usage["cache_read_input_tokens"] == usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert "cache_creation_input_tokens" in usage


def test_a_tenant_beyond_its_pin_limit_gets_429_and_holds_nothing(engine):
    long_docs = " ".join(f"Clause {i} binds the lessee." for i in range(40))  # ~200 tokens: 12 blocks > 8
    before = engine.metric("kvfleet:kv_pinned_blocks")
    r = post(engine, chat(long_docs, "q"), {FAIRNESS_HEADER: "tenant-big"})
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["code"] == "cache_pin_limit_exceeded" and "tenant 'tenant-big'" in err["message"]
    assert engine.metric("kvfleet:kv_pinned_blocks") == before
    assert engine.metric("vllm:num_requests_running") == 0 and engine.metric("vllm:num_requests_waiting") == 0
    ok = post(engine, chat(long_docs, "q", mark=False), {FAIRNESS_HEADER: "tenant-big"})
    assert ok.status_code == 200  # the same prompt without the mark runs


@pytest.mark.parametrize("where, cc, param, path", [
    ("part", {"type": "forever"}, "messages[0].content", "messages[0].content[0].cache_control.type"),
    ("part", {"type": "ephemeral", "ttl": "10m"}, "messages[0].content", "messages[0].content[0].cache_control.ttl"),
    ("message", {"type": "ephemeral", "ttl": "10m"}, "messages[1].cache_control.ttl",
     "messages[1].cache_control.ttl"),
])
def test_a_bad_cache_control_is_a_400_naming_the_field(engine, where, cc, param, path):
    """A content part's error names the content field (as any bad part does, tests/engine/server/test_errors.py) and
    the exact path in the message."""
    body = chat(DOCS, "q")
    if where == "part":
        body["messages"][0]["content"][0]["cache_control"] = cc
    else:
        body["messages"][1]["cache_control"] = cc
    r = post(engine, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and path in err["message"], err

"""cache_control breakpoints: one rule for router and engine, the path of a bad value named."""

from __future__ import annotations

import json

import pytest

from contract.cache_control import Breakpoint, CacheControlError, breakpoints, longest
from contract.request import Endpoint, RequestError, parse_request

EPH = {"type": "ephemeral"}


def test_breakpoints_in_prompt_order_with_their_ttls():
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "docs", "cache_control": EPH}]},
        {"role": "user", "content": "q", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        {"role": "assistant", "content": "a"},
    ]
    tools = [{"type": "function", "function": {"name": "f"}, "cache_control": EPH}]
    marks = breakpoints(messages, tools)
    assert marks == [Breakpoint(300.0, tool=0), Breakpoint(300.0, message=0, part=0), Breakpoint(3600.0, message=1)]
    assert longest(marks) == Breakpoint(3600.0, message=1)
    assert longest([]) is None
    assert breakpoints([{"role": "user", "content": "plain"}]) == []


@pytest.mark.parametrize("value, path", [
    ({"type": "persistent"}, "messages[0].content[0].cache_control.type"),
    ({"type": "ephemeral", "ttl": "2h"}, "messages[0].content[0].cache_control.ttl"),
    ({"type": "ephemeral", "ttl": 300}, "messages[0].content[0].cache_control.ttl"),
    ("ephemeral", "messages[0].content[0].cache_control"),
])
def test_a_bad_value_is_named_by_its_path(value, path):
    messages = [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": value}]}]
    with pytest.raises(CacheControlError) as e:
        breakpoints(messages)
    assert e.value.path == path
    with pytest.raises(RequestError) as r:  # the router's parse: a 400 naming the same field
        parse_request(Endpoint.CHAT, json.dumps({"messages": messages}).encode())
    assert r.value.param == path and r.value.status == 400


def test_the_router_keeps_the_field_for_the_engine():
    raw = json.dumps({"messages": [{"role": "user", "content": "q", "cache_control": EPH}]}).encode()
    req = parse_request(Endpoint.CHAT, raw)
    assert req.upstream_body() == raw

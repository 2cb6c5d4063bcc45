"""Tool-call parsing, exact: whole answers and every way of cutting them into streamed pieces."""

from __future__ import annotations

import itertools
import json

import pytest

from engine.structured.tool_parser import ToolCall, ToolCallStream, ToolMode, parse_auto, scan_call_array


def test_scan_call_array_whole_and_partial():
    text = '[{"name": "get_weather", "arguments": {"city": "Paris \\"}{", "n": [1, 2]}}, {"name":"f","arguments":{}}]'
    calls = scan_call_array(text)
    assert [(c.name, c.arguments(text)) for c in calls] == [
        ("get_weather", '{"city": "Paris \\"}{", "n": [1, 2]}'), ("f", "{}")]
    cut = text[:text.index('"n"')]
    (c,) = scan_call_array(cut)
    assert c.name == "get_weather" and c.args_end is None and c.arguments(cut) == '{"city": "Paris \\"}{", '
    assert scan_call_array('[{"name": "get_') == [scan_call_array('[{"name": "get_')[0]]
    assert scan_call_array('[{"name": "get_')[0].name is None
    (c,) = scan_call_array('[{"arguments": {"a": 1}, "name": "g"}]')  # either key order
    assert (c.name, c.arguments('[{"arguments": {"a": 1}, "name": "g"}]')) == ("g", '{"a": 1}')


@pytest.mark.parametrize("text, content, calls", [
    ("Hello there", "Hello there", []),
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', None, [ToolCall("f", '{"x": 1}')]),
    ('Sure.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": '
     '"{\\"y\\": 2}"}</tool_call>', "Sure.", [ToolCall("f", "{}"), ToolCall("g", '{"y": 2}')]),
    ('{"name": "f", "parameters": {"x": "a"}}', None, [ToolCall("f", '{"x": "a"}')]),  # Llama 3 JSON
    ('<|python_tag|>{"name": "f", "parameters": {}}', None, [ToolCall("f", "{}")]),
    ('{"name": "not_a_tool", "parameters": {}}', '{"name": "not_a_tool", "parameters": {}}', []),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ('<tool_call>{"name": "f", "arguments": {"x": 1}}', None, [ToolCall("f", '{"x": 1}')]),  # unclosed at EOS
])
def test_parse_auto(text, content, calls):
    assert parse_auto(text, ["f", "g"]) == (content, calls)


def _run(stream: ToolCallStream, pieces: list[str]) -> tuple[str, dict[int, dict]]:
    content, calls = "", {}
    for k, p in enumerate(pieces):
        c, deltas = stream.feed(p, k == len(pieces) - 1)
        content += c
        for d in deltas:
            call = calls.setdefault(d["index"], {"name": None, "arguments": "", "id": None})
            if "id" in d:
                assert call["id"] is None  # the header goes out once
                call["id"], call["name"] = d["id"], d["function"]["name"]
            call["arguments"] += d["function"]["arguments"]
    return content, calls


def _splits(text: str):
    for a, b in itertools.combinations(range(1, len(text)), 2):
        yield [text[:a], text[a:b], text[b:]]


def _ids():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def test_required_stream_adds_up_to_the_whole_answer_however_it_is_cut():
    text = '[{"name": "f", "arguments": {"q": "a}b"}}, {"name": "g", "arguments": {}}]'
    for pieces in _splits(text):
        content, calls = _run(ToolCallStream(ToolMode.REQUIRED, ["f", "g"], None, _ids()), pieces)
        assert content == ""
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("f", {"q": "a}b"}), ("g", {})]


def test_named_stream_streams_the_arguments():
    s = ToolCallStream(ToolMode.NAMED, ["f"], "f", _ids())
    first = s.feed("", False)
    assert first == ("", [{"index": 0, "id": "call_0", "type": "function", "function": {"name": "f", "arguments": ""}}])
    assert s.feed('{"x"', False) == ("", [{"index": 0, "function": {"arguments": '{"x"'}}])
    assert s.feed(": 1}", True) == ("", [{"index": 0, "function": {"arguments": ": 1}"}}])
    assert s.calls == [ToolCall("f", '{"x": 1}')]


@pytest.mark.parametrize("text, content, names", [
    ("Just text, no call.", "Just text, no call.", []),
    ('I will call it.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', "I will call it.", ["f"]),
    ('  {"name": "f", "parameters": {"x": 1}}', "", ["f"]),
    ("a < b <tool", "a < b <tool", []),
])
def test_auto_stream_matches_the_whole_parse(text, content, names):
    for pieces in _splits(text):
        got_content, calls = _run(ToolCallStream(ToolMode.AUTO, ["f"], None, _ids()), pieces)
        assert got_content == content, pieces
        assert [c["name"] for c in calls.values()] == names


def test_auto_without_parallel_calls_keeps_the_first():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>'
    s = ToolCallStream(ToolMode.AUTO, ["f", "g"], None, _ids(), parallel=False)
    assert s.feed(text, True) == ("", [{"index": 0, "id": "call_0", "type": "function",
                                        "function": {"name": "f", "arguments": "{}"}}])

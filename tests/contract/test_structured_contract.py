"""contract/structured.py and contract/tool_prompt.py, exact."""

from __future__ import annotations

import pytest

from contract.messages import MessageError, chat_messages
from contract.structured import constrained_kind
from contract.tool_prompt import template_renders_tools, tool_messages

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("body, kind", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "json_schema"),
    ({"guided_json": {"type": "object"}}, "json_schema"),
    ({"guided_regex": "a+"}, "regex"),
    ({"guided_choice": ["a"]}, "choice"),
    ({"guided_grammar": "root ::= \"a\""}, "grammar"),
    ({"structured_outputs": {"choice": ["a"]}}, "choice"),
    ({"structured_outputs": {"json_object": True}}, "json_object"),
    ({"tools": [TOOL]}, "tools"),
    ({"tools": [TOOL], "tool_choice": "none"}, None),
    ({"tools": []}, None),
    ({"response_format": "json"}, None),  # untrusted shapes: no error, no kind
    ({"structured_outputs": 5}, None),
])
def test_constrained_kind(body, kind):
    assert constrained_kind(body) == kind


def test_tool_messages_inline_for_a_template_without_tools():
    msgs = chat_messages([
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}])
    out = tool_messages(msgs, [TOOL], native=False)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}' in out[0]["content"]
    assert out[1] == {"role": "assistant", "content": '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'}
    assert out[2] == {"role": "tool", "content": "<tool_response>\n42\n</tool_response>"}


def test_tool_messages_native_keeps_calls_with_object_arguments():
    msgs = chat_messages([{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}])
    (m,) = tool_messages(msgs, [TOOL], native=True)
    assert m["tool_calls"] == [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]
    assert template_renders_tools("{% if tools %}...{% endif %}") and not template_renders_tools("{{ messages }}")


def test_bad_tool_calls_in_history_name_the_message():
    with pytest.raises(MessageError, match=r"messages\[0\]\.tool_calls\[0\]"):
        chat_messages([{"role": "assistant", "tool_calls": [{"function": {"name": 3}}]}])

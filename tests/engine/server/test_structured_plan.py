"""engine/server/structured.py: request fields → the guide and the tool plan, exact, without a model."""

from __future__ import annotations

import json

import pytest

from engine.server.errors import APIError
from engine.server.protocol import ChatCompletionRequest, CompletionRequest
from engine.server.structured import structured_plan
from engine.structured.spec import GuideKind
from engine.structured.tool_parser import ToolMode

MSGS = [{"role": "user", "content": "hi"}]
P = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": P}},
         {"type": "function", "function": {"name": "g"}}]


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MSGS, **kw})


def test_no_structure():
    plan = structured_plan(chat())
    assert plan.guide is None and plan.tools is None and plan.prompt_tools is None


def test_response_format_and_vllm_fields():
    g = structured_plan(chat(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": P}})).guide
    assert (g.kind, json.loads(g.text), g.param) == (GuideKind.JSON_SCHEMA, P, "response_format.json_schema.schema")
    assert structured_plan(chat(response_format={"type": "json_object"})).guide.kind is GuideKind.JSON_OBJECT
    assert structured_plan(chat(response_format={"type": "text"})).guide is None
    g = structured_plan(chat(guided_json=json.dumps(P))).guide
    assert (g.kind, g.param) == (GuideKind.JSON_SCHEMA, "guided_json")
    g = structured_plan(chat(structured_outputs={"regex": "a+"})).guide
    assert (g.kind, g.text, g.param) == (GuideKind.REGEX, "a+", "structured_outputs.regex")
    g = structured_plan(CompletionRequest.model_validate({"prompt": "x", "guided_choice": ["a", "b"]})).guide
    assert (g.kind, g.choices()) == (GuideKind.CHOICE, ["a", "b"])


def test_tool_choices():
    auto = structured_plan(chat(tools=TOOLS))
    assert auto.guide is None and auto.tools.mode is ToolMode.AUTO and auto.tools.names == ("f", "g")
    assert [t["function"]["name"] for t in auto.prompt_tools] == ["f", "g"]
    none = structured_plan(chat(tools=TOOLS, tool_choice="none"))
    assert none.tools is None and none.guide is None and none.prompt_tools  # the model still sees them
    named = structured_plan(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f"}}))
    assert named.tools.mode is ToolMode.NAMED and named.tools.name == "f"
    assert (json.loads(named.guide.text), named.guide.param) == (P, "tools[0].function.parameters")
    req = structured_plan(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    assert req.tools.mode is ToolMode.REQUIRED and req.guide.param == "tools"
    empty = {"type": "object", "properties": {}}
    assert json.loads(req.guide.text) == {"type": "array", "minItems": 1, "maxItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"enum": ["f"]}, "arguments": P}, "required": ["name", "arguments"],
         "additionalProperties": False},
        {"type": "object", "properties": {"name": {"enum": ["g"]}, "arguments": empty},
         "required": ["name", "arguments"], "additionalProperties": False}]}}
    assert "maxItems" not in json.loads(structured_plan(chat(tools=TOOLS, tool_choice="required")).guide.text)


@pytest.mark.parametrize("kw, param", [
    ({"tools": TOOLS + [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"guided_json": "[1, 2"}, "guided_json"),
    ({"guided_json": {"type": 12}}, "guided_json"),
])
def test_refusals_name_the_field(kw, param):
    with pytest.raises(APIError) as e:
        structured_plan(chat(**kw))
    assert (e.value.status, e.value.param) == (400, param)

"""A request's structured-output fields → what the engine constrains (a Guide) and how the answer is read.

    plan = structured_plan(req)                 # APIError 400 naming the field for anything wrong
    prompt tools: plan.prompt_tools;  params: plan.guide;  answer: plan.tools (a ToolPlan) or None
    await compile_guide(engine, plan)           # on the grammar worker; a 400 naming the field if it fails

At most one constraint per request: `response_format` (json_object / json_schema), vLLM's `guided_*` or
`structured_outputs`, or the tool choice. Tool choice: "none" (tools only shown to the model), "auto"
(free text, parsed for calls), "required" (a JSON array of calls {"name", "arguments"}, each valid for its
tool's parameters; one call when parallel_tool_calls is false), a named function (its arguments, valid
for its parameters). Every tool's parameters must be a JSON Schema whatever the choice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.server.errors import bad_request
from engine.server.protocol import ChatCompletionRequest, _SamplingRequest
from engine.structured.grammars import check_json_schema
from engine.structured.spec import Guide
from engine.structured.tool_parser import ToolMode

_EMPTY_PARAMS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    mode: ToolMode
    names: tuple[str, ...]
    name: str | None = None  # the named function
    parallel: bool = True  # parallel_tool_calls


@dataclass(frozen=True)
class StructuredPlan:
    guide: Guide | None = None
    tools: ToolPlan | None = None
    prompt_tools: list[dict] | None = None  # what the chat template shows the model
    tool_guides: tuple[Guide, ...] = ()  # each tool's own schema (compiled first, to name a failing tool)


def structured_plan(req: _SamplingRequest) -> StructuredPlan:
    guides = _format_guides(req)
    tools = req.tools if isinstance(req, ChatCompletionRequest) else None
    choice = req.tool_choice if isinstance(req, ChatCompletionRequest) else None
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return StructuredPlan(guide=_one(guides))
    prompt_tools = [t.model_dump(exclude_none=True) for t in tools]
    params = []
    for i, t in enumerate(tools):
        field = f"tools[{i}].function.parameters"
        schema = t.function.parameters if t.function.parameters is not None else _EMPTY_PARAMS
        try:
            check_json_schema(schema, field)
        except InvalidRequestError as e:
            raise bad_request(str(e), field) from None
        if schema.get("type", "object") != "object":
            raise bad_request(f"{field} must describe an object (\"type\": \"object\")", field)
        params.append(schema)
    names = tuple(t.function.name for t in tools)
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names", "tools")
    if choice in (None, "auto", "none"):
        mode = None if choice == "none" else ToolPlan(ToolMode.AUTO, names, parallel=req.parallel_tool_calls is not False)
        return StructuredPlan(guide=_one(guides), tools=mode, prompt_tools=prompt_tools)
    if guides:
        raise bad_request(f"{guides[0].param} cannot be combined with tool_choice {_choice_text(choice)}",
                          guides[0].param.split(".")[0])
    tool_guides = tuple(Guide.json_schema(p, f"tools[{i}].function.parameters") for i, p in enumerate(params))
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"enum": [n]}, "arguments": p},
                  "required": ["name", "arguments"], "additionalProperties": False} for n, p in zip(names, params, strict=True)]
        schema = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return StructuredPlan(Guide.json_schema(schema, "tools"), ToolPlan(ToolMode.REQUIRED, names), prompt_tools,
                              tool_guides)
    if choice.function.name not in names:
        raise bad_request(f"tool_choice names function {choice.function.name!r}, which is not among the tools "
                          f"{list(names)}", "tool_choice.function.name")
    i = names.index(choice.function.name)
    return StructuredPlan(tool_guides[i], ToolPlan(ToolMode.NAMED, names, names[i]), prompt_tools, (tool_guides[i],))


async def compile_guide(grammars, plan: StructuredPlan) -> None:
    """Compile the plan's grammars off the event loop (each is cached); a 400 naming the field if one fails."""
    try:
        for g in plan.tool_guides:
            await grammars.compile_async(g)
        if plan.guide is not None:
            await grammars.compile_async(plan.guide)
    except InvalidRequestError as e:
        raise bad_request(str(e), e.param) from None


def _choice_text(choice) -> str:
    return json.dumps(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


def _one(guides: list[Guide]) -> Guide | None:
    if len(guides) > 1:
        raise bad_request(f"only one of response_format, guided_json, guided_regex, guided_choice, guided_grammar "
                          f"and structured_outputs may be set (got {guides[0].param} and {guides[1].param})",
                          guides[1].param.split(".")[0])
    return guides[0] if guides else None


def _format_guides(req: _SamplingRequest) -> list[Guide]:
    out = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        out.append(Guide.json_object("response_format"))
    elif rf is not None and rf.type == "json_schema":
        out.append(_schema_guide(rf.json_schema.schema_, "response_format.json_schema.schema"))
    if req.guided_json is not None:
        out.append(_schema_guide(req.guided_json, "guided_json"))
    if req.guided_regex is not None:
        out.append(Guide.regex(req.guided_regex, "guided_regex"))
    if req.guided_choice is not None:
        out.append(Guide.choice(req.guided_choice, "guided_choice"))
    if req.guided_grammar is not None:
        out.append(Guide.grammar(req.guided_grammar, "guided_grammar"))
    so = req.structured_outputs
    if so is not None:
        picked = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                      ("grammar", so.grammar), ("json_object", so.json_object or None))
                  if v is not None]
        if len(picked) != 1:
            raise bad_request("structured_outputs must set exactly one of json, regex, choice, grammar, json_object",
                              "structured_outputs")
        kind, v = picked[0]
        field = f"structured_outputs.{kind}"
        out.append({"json": lambda: _schema_guide(v, field), "regex": lambda: Guide.regex(v, field),
                    "choice": lambda: Guide.choice(v, field), "grammar": lambda: Guide.grammar(v, field),
                    "json_object": lambda: Guide.json_object(field)}[kind]())
    return out


def _schema_guide(schema: object, field: str) -> Guide:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise bad_request(f"{field} is not valid JSON: {e}", field) from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    try:
        check_json_schema(schema, field)
    except InvalidRequestError as e:
        raise bad_request(str(e), field) from None
    return Guide.json_schema(schema, field)

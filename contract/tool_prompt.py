"""Tools in the prompt, the same for the engine and the router (so the router's prompt tokens stay the engine's).

    messages = tool_messages(messages, tools, native)   # after contract.messages.chat_messages

A chat template that renders tools itself (Llama 3.1, Qwen2.5, Hermes: its text mentions `tools`) gets
them as the template's `tools` argument (engine/tokenizer.py) and the messages as they are, with each
assistant tool call's `arguments` as an object (what those templates write with `tojson`). A template
without tools (SmolLM2's) gets the Hermes / Qwen2.5 convention written out: a system message listing the
tools in <tools></tools> and asking for <tool_call>{"name": ..., "arguments": ...}</tool_call>; assistant
tool calls become that text, tool results are wrapped in <tool_response></tool_response>.
Pure, stdlib only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


def template_renders_tools(template: str | None) -> bool:
    return template is not None and "tools" in template


def tool_messages(messages: Sequence[Mapping], tools: Sequence[Mapping] | None, native: bool) -> list[dict]:
    if native:
        return [_native(m) for m in messages]
    out = [_inline(m) for m in messages]
    if tools:
        prompt = _TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def call_text(name: str, arguments: object) -> str:
    """One tool call as the inline convention writes it."""
    return f"{TOOL_CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"


def _arguments(call: Mapping) -> object:
    args = call.get("function", {}).get("arguments")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args if args is not None else {}


def _native(m: Mapping) -> dict:
    if not m.get("tool_calls"):
        return dict(m)
    calls = [{**c, "function": {**c.get("function", {}), "arguments": _arguments(c)}} for c in m["tool_calls"]]
    return {**m, "tool_calls": calls}


def _inline(m: Mapping) -> dict:
    out = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
    if m.get("tool_calls"):
        calls = "\n".join(call_text(c.get("function", {}).get("name", ""), _arguments(c)) for c in m["tool_calls"])
        out["content"] = f"{m['content']}\n{calls}" if m.get("content") else calls
    elif m.get("role") == "tool":
        out["content"] = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
    return out

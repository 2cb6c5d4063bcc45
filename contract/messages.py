"""Chat messages as the chat template receives them: `{"role", "content"[, "name", "tool_calls", "tool_call_id"]}`.

The engine's server and offline API and the router all normalise with `chat_messages` before applying the
chat template, so the router's prompt token ids (its cache-hit prediction) are the engine's. Content may be
a string, null (empty) or a list of OpenAI text parts (joined); an empty name is left out; an assistant's
`tool_calls` and a tool message's `tool_call_id` are kept (contract/tool_prompt.py renders them); other
fields (refusal, ...) do not reach the template.
"""

from __future__ import annotations

from collections.abc import Mapping


class MessageError(ValueError):
    """The messages cannot be given to a chat template; the message names the offending field."""


def chat_messages(messages: object) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise MessageError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(i: int, m: object) -> dict:
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
        raise MessageError(f"messages[{i}] must be an object with a string 'role'")
    out = {"role": m["role"], "content": _text(i, m.get("content"))}
    name = m.get("name")
    if name is not None and not isinstance(name, str):
        raise MessageError(f"messages[{i}].name must be a string")
    if name:
        out["name"] = name
    calls = m.get("tool_calls")
    if calls:
        out["tool_calls"] = _tool_calls(i, calls)
    call_id = m.get("tool_call_id")
    if isinstance(call_id, str) and call_id:
        out["tool_call_id"] = call_id
    return out


def _tool_calls(i: int, calls: object) -> list[dict]:
    if not isinstance(calls, list):
        raise MessageError(f"messages[{i}].tool_calls must be a list")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments", ""), str):
            raise MessageError(f"messages[{i}].tool_calls[{j}] must be {{'id', 'type': 'function', "
                               f"'function': {{'name': str, 'arguments': str}}}}")
        out.append({"id": str(c.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn.get("arguments", "")}})
    return out


def _text(i: int, content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, Mapping) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise MessageError(f"messages[{i}].content[{j}] must be a text part {{'type': 'text', 'text': ...}}")
            parts.append(p["text"])
        return "".join(parts)
    raise MessageError(f"messages[{i}].content must be a string or a list of text parts")

"""Chat messages as the chat template receives them: `{"role", "content"[, "name"]}` with text content.

The engine's server and offline API and the router all normalise with `chat_messages` before applying the
chat template, so the router's prompt token ids (its cache-hit prediction) are the engine's. Content may be
a string, null (empty) or a list of OpenAI text parts (joined); an empty name is left out; other fields
(tool_calls, refusal, ...) do not reach the template.
"""

from __future__ import annotations

from collections.abc import Mapping


class MessageError(ValueError):
    """The messages cannot be given to a chat template; the message names the offending field."""


def chat_messages(messages: object) -> list[dict[str, str]]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise MessageError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(i: int, m: object) -> dict[str, str]:
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
        raise MessageError(f"messages[{i}] must be an object with a string 'role'")
    out = {"role": m["role"], "content": _text(i, m.get("content"))}
    name = m.get("name")
    if name is not None and not isinstance(name, str):
        raise MessageError(f"messages[{i}].name must be a string")
    if name:
        out["name"] = name
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

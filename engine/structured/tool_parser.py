"""Tool calls out of generated text, whole or while it streams. Pure: no I/O.

Three shapes, by the request's tool_choice (engine/server/tools.py picks the mode):
- NAMED: the answer is the function's arguments (constrained to its parameters schema).
- REQUIRED: the answer is a JSON array of {"name": ..., "arguments": {...}} (constrained: a valid call).
- AUTO: free text; calls are <tool_call>{"name": ..., "arguments": ...}</tool_call> blocks (Hermes, Qwen2.5,
  and the inline convention of contract/tool_prompt.py), or, Llama 3 style, the whole answer is one JSON
  call {"name": ..., "parameters"|"arguments": ...} (optionally after <|python_tag|>) naming a declared tool.

    scan_call_array(text) -> [PartialCall]          # REQUIRED, also on a prefix of the answer
    parse_auto(text, names) -> (content, [ToolCall])
    s = ToolCallStream(mode, name, new_id); content, deltas = s.feed(text_delta, final)

A call's `arguments` is the exact text the model wrote for it (a JSON object once complete), so the
streamed argument deltas add up to the final `arguments`.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


class ToolMode(enum.Enum):
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text


@dataclass
class PartialCall:
    name: str | None = None  # once its string is complete
    args_start: int | None = None  # index in the text where the arguments value begins
    args_end: int | None = None  # index just past it, once complete

    def arguments(self, text: str) -> str:
        return "" if self.args_start is None else text[self.args_start:self.args_end]


def scan_call_array(text: str) -> list[PartialCall]:
    """The calls of `[{"name": "f", "arguments": {...}}, ...]` (any whitespace, either key order), as far as
    `text` goes. Strings are scanned with their escapes; arguments are the raw text of their value."""
    calls: list[PartialCall] = []
    depth = 0
    in_str = esc = False
    str_start = 0
    key: str | None = None  # the last key read at depth 2 (inside a call object)
    value_of: str | None = None  # the key whose value comes next at depth 2
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                if depth == 2 and calls:
                    s = text[str_start:i + 1]
                    if value_of is None:
                        key = json.loads(s)
                    elif value_of == "name":
                        calls[-1].name = json.loads(s)
                    elif value_of == "arguments" and calls[-1].args_start is None:
                        calls[-1].args_start, calls[-1].args_end = str_start, i + 1
            continue
        if ch == '"':
            in_str, str_start = True, i
        elif ch in "{[":
            depth += 1
            if depth == 2 and ch == "{":
                calls.append(PartialCall())
                key = value_of = None
            elif depth == 3 and value_of == "arguments" and calls and calls[-1].args_start is None:
                calls[-1].args_start = i
        elif ch in "}]":
            if depth == 3 and calls and calls[-1].args_start is not None and calls[-1].args_end is None:
                calls[-1].args_end = i + 1
            depth -= 1
        elif depth == 2 and ch == ":":
            value_of = key
        elif depth == 2 and ch == ",":
            key = value_of = None
    return calls


def parse_auto(text: str, names: Sequence[str]) -> tuple[str | None, list[ToolCall]]:
    """(content before the first call, or all of it without calls; calls). A block that is not a valid call
    leaves the whole text as content."""
    stripped = text.strip()
    if stripped.startswith(PYTHON_TAG):
        stripped = stripped[len(PYTHON_TAG):].strip()
    if stripped[:1] in "{[":
        calls = _json_calls(stripped, names)
        if calls:
            return None, calls
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls, pos = [], start
    while pos >= 0:
        end = text.find(CLOSE, pos)
        body = text[pos + len(OPEN):end if end >= 0 else len(text)].strip()
        call = _call(_loads(body))
        if call is None:
            return text, []
        calls.append(call)
        pos = text.find(OPEN, end) if end >= 0 else -1
    content = text[:start].rstrip()
    return (content if content.strip() else None), calls


def _loads(s: str) -> object:
    try:
        return json.loads(s)
    except ValueError:
        return None


def _call(obj: object) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _loads(args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_calls(text: str, names: Sequence[str]) -> list[ToolCall]:
    obj = _loads(text)
    items = obj if isinstance(obj, list) else [obj]
    calls = [_call(o) for o in items]
    if not calls or any(c is None or c.name not in names for c in calls):
        return []
    return calls  # type: ignore[return-value]


class ToolCallStream:
    """One choice's answer as it streams: content to send, and OpenAI `tool_calls` deltas.

    feed(delta, final) -> (content, [{"index", "id", "type", "function": {"name", "arguments"}} | {"index",
    "function": {"arguments"}}]). AUTO holds back text that may turn out to be a call (an answer that starts
    with `{`, `[` or <|python_tag|>, and anything from <tool_call> on) and decides at the end."""

    def __init__(self, mode: ToolMode, names: Sequence[str], name: str | None, new_id: Callable[[], str],
                 parallel: bool = True):
        """parallel: False keeps only an AUTO answer's first call (REQUIRED is constrained to one already)."""
        self.mode = mode
        self.parallel = parallel
        self.names = tuple(names)
        self.name = name
        self._new_id = new_id
        self.text = ""
        self._content_sent = 0
        self._sent: list[int] = []  # per call: argument characters sent
        self.calls: list[ToolCall] = []  # the finished answer's calls, once final

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict]]:
        self.text += delta
        if self.mode is ToolMode.NAMED:
            return "", self._deltas([(self.name, 0, None)], final)
        if self.mode is ToolMode.REQUIRED:
            scanned = scan_call_array(self.text)
            return "", self._deltas([(c.name, c.args_start, c.args_end) for c in scanned], final)
        return self._auto(final)

    def _deltas(self, calls: list[tuple[str | None, int | None, int | None]], final: bool) -> list[dict]:
        out = []
        for j, (name, start, end) in enumerate(calls):
            if name is None:
                break
            if j == len(self._sent):
                self._sent.append(0)
                out.append({"index": j, "id": self._new_id(), "type": "function",
                            "function": {"name": name, "arguments": ""}})
            args = "" if start is None else self.text[start:end]
            if len(args) > self._sent[j]:
                piece = args[self._sent[j]:]
                self._sent[j] = len(args)
                if out and out[-1]["index"] == j:
                    out[-1]["function"]["arguments"] += piece
                else:
                    out.append({"index": j, "function": {"arguments": piece}})
            if final:
                self.calls.append(ToolCall(name, args))
        return out

    def _auto(self, final: bool) -> tuple[str, list[dict]]:
        if final:
            content, calls = parse_auto(self.text, self.names)
            calls = calls if self.parallel else calls[:1]
            if not calls:
                return self._release(len(self.text)), []
            self.calls = calls
            rest = (content or "")[self._content_sent:]
            out = [{"index": j, "id": self._new_id(), "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments}} for j, c in enumerate(calls)]
            return rest, out
        lead = self.text.lstrip()
        if self._content_sent == 0 and (not lead or lead[0] in "{[" or lead.startswith(PYTHON_TAG)
                                        or PYTHON_TAG.startswith(lead)):
            return "", []  # may still be a bare JSON call
        at = self.text.find(OPEN)
        upto = at if at >= 0 else len(self.text) - _partial_suffix(self.text, OPEN)
        while upto > self._content_sent and self.text[upto - 1].isspace():  # whitespace before a call is dropped
            upto -= 1
        return self._release(upto), []

    def _release(self, upto: int) -> str:
        out = self.text[self._content_sent:upto] if upto > self._content_sent else ""
        self._content_sent = max(self._content_sent, upto)
        return out


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back: it may become the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0

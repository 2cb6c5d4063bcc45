"""Anthropic-style cache breakpoints: `"cache_control": {"type": "ephemeral", "ttl": "5m" | "1h"}` on a chat
message, on one of its content parts, or on a `tools` entry.

A breakpoint marks a prefix of the prompt: everything the chat template renders up to and including what carries
it. The engine keeps (pins) the whole KV blocks of the longest marked prefix for the TTL (engine/kv/pins.py);
every shorter one lies inside it. `ttl` is optional ("5m", Anthropic's default). The rule is checked once, the same
for router and engine (contract/request.py; the engine's pydantic models in engine/server/protocol.py state it
too); a value breaking it is a 400 naming its path (`messages[1].content[0].cache_control.ttl`). Pure, stdlib only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

CACHE_CONTROL = "cache_control"
CACHE_CONTROL_TYPES = ("ephemeral",)
CACHE_CONTROL_TTLS = {"5m": 300.0, "1h": 3600.0}
DEFAULT_TTL = "5m"


class CacheControlError(ValueError):
    """A cache_control value breaks the rule; `path` names it."""

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path


@dataclass(frozen=True)
class Breakpoint:
    """Where a cache_control sits: a `tools` entry (tool), a whole message (message), or one content part of it
    (message, part); and its TTL in seconds."""

    ttl_s: float
    message: int | None = None
    part: int | None = None
    tool: int | None = None


def cache_control_ttl(value: object, path: str) -> float:
    """The TTL in seconds of one cache_control value, or CacheControlError naming `path`."""
    if not isinstance(value, Mapping):
        raise CacheControlError(f"{path} must be an object {{'type': 'ephemeral', 'ttl': '5m' | '1h'}}", path)
    kind = value.get("type")
    if kind not in CACHE_CONTROL_TYPES:
        raise CacheControlError(f"{path}.type must be 'ephemeral', got {json.dumps(kind)[:40]}", f"{path}.type")
    ttl = value.get("ttl", DEFAULT_TTL)
    if not isinstance(ttl, str) or ttl not in CACHE_CONTROL_TTLS:
        raise CacheControlError(f"{path}.ttl must be '5m' or '1h', got {json.dumps(ttl)[:40]}", f"{path}.ttl")
    return CACHE_CONTROL_TTLS[ttl]


def breakpoints(messages: object, tools: object = None) -> list[Breakpoint]:
    """Every breakpoint of a chat request, tools first, then messages in order (the order the prompt renders
    them), or CacheControlError for the first bad value. Shapes other than objects and lists are left to the
    fields' own checks."""
    out: list[Breakpoint] = []
    for t, tool in enumerate(tools if isinstance(tools, list) else ()):
        if isinstance(tool, Mapping) and tool.get(CACHE_CONTROL) is not None:
            out.append(Breakpoint(cache_control_ttl(tool[CACHE_CONTROL], f"tools[{t}].{CACHE_CONTROL}"), tool=t))
    for i, m in enumerate(messages if isinstance(messages, list) else ()):
        if not isinstance(m, Mapping):
            continue
        content = m.get("content")
        for j, p in enumerate(content if isinstance(content, list) else ()):
            if isinstance(p, Mapping) and p.get(CACHE_CONTROL) is not None:
                path = f"messages[{i}].content[{j}].{CACHE_CONTROL}"
                out.append(Breakpoint(cache_control_ttl(p[CACHE_CONTROL], path), message=i, part=j))
        if m.get(CACHE_CONTROL) is not None:
            out.append(Breakpoint(cache_control_ttl(m[CACHE_CONTROL], f"messages[{i}].{CACHE_CONTROL}"), message=i))
    return out


def longest(marks: list[Breakpoint]) -> Breakpoint | None:
    """The breakpoint whose prefix holds every other one (the last in prompt order), with the longest TTL of them
    all: the prefix of a shorter breakpoint lies inside it, and its blocks are kept as long as any asks."""
    if not marks:
        return None
    last = marks[-1]
    return Breakpoint(max(b.ttl_s for b in marks), last.message, last.part, last.tool)

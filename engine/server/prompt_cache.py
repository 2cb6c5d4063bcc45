"""The cache_control prefix of a chat request (contract/cache_control.py): how many of its prompt tokens it marks.

    pin = cache_pin(tokenizer, req, messages, tools, prompt_ids)   # engine.kv.pins.CachePin, or None

Only the longest breakpoint counts (every shorter one lies inside it; the longest TTL of them all is kept). Its
prefix is measured by rendering the chat template for the conversation cut right after the marked part (the
messages before it, the marked message's text up to and including the part; for a `tools` entry, the system
message with the tools up to it), tokenizing that, and taking the longest common prefix with the real prompt's
tokens: whatever the template appends to close a cut message never counts, and a token merged across the cut
ends the prefix one token early. The engine pins the whole KV blocks inside it (engine/kv/pins.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from contract.cache_control import CACHE_CONTROL_TTLS, Breakpoint, longest
from engine.cache_pin import CachePin
from engine.server.protocol import ChatCompletionRequest
from engine.tokenizer import Tokenizer, TokenizerError


def marks(req: ChatCompletionRequest) -> list[Breakpoint]:
    """The request's breakpoints in prompt order (tools, then each message's parts and the message itself)."""
    out: list[Breakpoint] = []
    for t, tool in enumerate(req.tools or ()):
        if tool.cache_control is not None:
            out.append(Breakpoint(CACHE_CONTROL_TTLS[tool.cache_control.ttl], tool=t))
    for i, m in enumerate(req.messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
            if part.cache_control is not None:
                out.append(Breakpoint(CACHE_CONTROL_TTLS[part.cache_control.ttl], message=i, part=j))
        if m.cache_control is not None:
            out.append(Breakpoint(CACHE_CONTROL_TTLS[m.cache_control.ttl], message=i))
    return out


def cache_pin(tokenizer: Tokenizer, req: ChatCompletionRequest, messages: list[dict],
              tools: list[dict] | None, prompt_ids: Sequence[int]) -> CachePin | None:
    """messages: the request's, normalised (contract/messages.py); tools: those the template shows."""
    mark = longest(marks(req))
    if mark is None:
        return None
    cut_tools: list[dict] | None
    if mark.tool is not None:
        if not tools:
            return CachePin(0, mark.ttl_s)  # the template shows no tools (tool_choice "none"): nothing marked
        head = messages[:1] if messages and messages[0]["role"] in ("system", "developer") else []
        cut, cut_tools = head, tools[:mark.tool + 1]
    elif mark.message is not None:
        cut, cut_tools = messages[:mark.message + 1], tools
        content = req.messages[mark.message].content
        if mark.part is not None and isinstance(content, list):
            cut[-1] = {**cut[-1], "content": "".join(p.text for p in content[:mark.part + 1])}
    else:
        return None
    try:
        ids = tokenizer.apply_chat_template(cut, add_generation_prompt=False, tools=cut_tools)
    except TokenizerError:
        return CachePin(0, mark.ttl_s)  # the template cannot render the cut conversation: nothing measurable
    return CachePin(common_prefix(ids, prompt_ids), mark.ttl_s)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):  # up to the shorter one
        if x != y:
            break
        n += 1
    return n

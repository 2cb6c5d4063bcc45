"""`return_token_ids` (contract/token_ids.py, vLLM's wire) on hand-made deltas: a chunk for every token, held-back
text included, with its ids; the prompt's ids at the top of a chat stream's first chunk and on each completions
choice's first chunk; whole responses carry them too."""

from __future__ import annotations

import asyncio
import json

from engine.outputs import CompletionDelta, RequestDelta
from engine.server.formatter import ChatFormat, CompletionFormat, Reply


def _delta(*outputs: CompletionDelta, finished: bool = False) -> RequestDelta:
    return RequestDelta("r", list(outputs), finished, num_prompt_tokens=3)


async def _outs(items):
    for item in items:
        yield 0, item


def _stream(fmt, items, n: int = 1) -> list[dict]:
    async def collect():
        reply = Reply(fmt, "r", "m", 0, n, False, None, [[7, 8, 9]])
        return [raw async for raw in reply.stream(_outs(items), 1, False, False)]

    return [json.loads(raw[6:-2]) for raw in asyncio.run(collect()) if raw != b"data: [DONE]\n\n"]


DELTAS = [_delta(CompletionDelta(0, "Hi", [1])), _delta(CompletionDelta(0, "", [2])),  # text held back
          _delta(CompletionDelta(0, " x", [3], finish_reason="length"), finished=True)]


def test_chat_stream_carries_every_tokens_ids_and_the_prompt_once():
    events = _stream(ChatFormat(str), DELTAS)
    assert [e["choices"][0]["token_ids"] for e in events] == [[1], [2], [3]]
    assert [e["choices"][0]["delta"] for e in events] == [{"role": "assistant", "content": "Hi"}, {}, {"content": " x"}]
    assert [e.get("prompt_token_ids") for e in events] == [[7, 8, 9], None, None]


def test_completions_stream_has_the_prompt_on_each_choices_first_chunk():
    events = _stream(CompletionFormat(str), [_delta(CompletionDelta(0, "a", [1]), CompletionDelta(1, "b", [2])),
                                             _delta(CompletionDelta(1, "c", [3], finish_reason="length"),
                                                    CompletionDelta(0, "d", [4], finish_reason="length"),
                                                    finished=True)], n=2)
    got = [(e["choices"][0]["index"], e["choices"][0]["token_ids"], e["choices"][0].get("prompt_token_ids"))
           for e in events]
    assert got == [(0, [1], [7, 8, 9]), (1, [2], [7, 8, 9]), (1, [3], None), (0, [4], None)]


def test_whole_responses_carry_the_ids():
    async def collect(fmt):
        return await Reply(fmt, "r", "m", 0, 1, False, None, [[7, 8, 9]]).collect(_outs(DELTAS), 1)

    chat = asyncio.run(collect(ChatFormat(str)))
    assert chat["prompt_token_ids"] == [7, 8, 9] and chat["choices"][0]["token_ids"] == [1, 2, 3]
    cmpl = asyncio.run(collect(CompletionFormat(str)))
    assert cmpl["choices"][0]["prompt_token_ids"] == [7, 8, 9] and cmpl["choices"][0]["token_ids"] == [1, 2, 3]


def test_without_it_nothing_changes():
    async def collect():
        reply = Reply(ChatFormat(str), "r", "m", 0, 1, False)
        return [raw async for raw in reply.stream(_outs(DELTAS), 1, False, False)]

    events = [json.loads(raw[6:-2]) for raw in asyncio.run(collect()) if raw != b"data: [DONE]\n\n"]
    assert len(events) == 2 and all("token_ids" not in e["choices"][0] and "prompt_token_ids" not in e
                                    for e in events)

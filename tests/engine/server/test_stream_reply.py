"""Reply.stream on hand-made deltas (pure, no model): nothing goes out before a choice's first token, a chat
choice's first chunk carries its role and its first text, and a failure or abort before the first chunk is
raised as an APIError (the HTTP status is still free), after it an SSE error event."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine.errors import RequestOutOfMemoryError
from engine.outputs import CompletionDelta, RequestDelta
from engine.server.errors import APIError
from engine.server.formatter import ChatFormat, CompletionFormat, Reply


def _delta(*outputs: CompletionDelta, finished: bool = False) -> RequestDelta:
    return RequestDelta("r", list(outputs), finished, num_prompt_tokens=5)


async def _outs(items):
    for item in items:
        if isinstance(item, Exception):
            raise item
        yield 0, item


def run(fmt, items, n: int = 1, echo: list[str] | None = None, include_usage: bool = False) -> list[dict | str]:
    """The stream's events: parsed chunks, and "[DONE]"."""

    async def collect():
        reply = Reply(fmt, "r", "m", 0, n, False, echo)
        return [raw async for raw in reply.stream(_outs(items), 1, include_usage, False)]

    out = []
    for raw in asyncio.run(collect()):
        assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
        data = raw[6:-2].decode()
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def chat():
    return ChatFormat(lambda t: str(t))


def completion():
    return CompletionFormat(lambda t: str(t))


def test_chat_first_chunk_of_each_choice_has_role_and_first_text():
    events = run(chat(), [
        _delta(CompletionDelta(0, "Hel", [1]), CompletionDelta(1, "", [2])),  # choice 1's text is held back
        _delta(CompletionDelta(1, "Wor", [3])),
        _delta(CompletionDelta(0, "lo", [4], finish_reason="length"), CompletionDelta(1, "ld", [5])),
        _delta(CompletionDelta(1, "", [], finish_reason="stop", stop_reason=2), finished=True),
    ], n=2)
    deltas = [(e["choices"][0]["index"], e["choices"][0]["delta"], e["choices"][0]["finish_reason"])
              for e in events[:-1]]
    assert deltas == [
        (0, {"role": "assistant", "content": "Hel"}, None),
        (1, {"role": "assistant", "content": "Wor"}, None),
        (0, {"content": "lo"}, "length"),
        (1, {"content": "ld"}, None),
        (1, {}, "stop"),
    ]
    assert events[-1] == "[DONE]"


def test_a_chat_choice_that_ends_without_text_gets_its_role_in_its_finishing_chunk():
    events = run(chat(), [_delta(CompletionDelta(0, "", [7], finish_reason="stop", stop_reason="x"), finished=True)],
                 include_usage=True)
    assert events[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": "stop", "stop_reason": "x"}]
    assert events[1]["usage"]["completion_tokens"] == 1 and events[2] == "[DONE]"


def test_completions_first_chunk_is_the_echo_and_first_text():
    events = run(completion(), [_delta(CompletionDelta(0, " a", [1])),
                                _delta(CompletionDelta(0, " b", [2], finish_reason="length"), finished=True)],
                 echo=["Say"])
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["Say a", " b"]


def test_an_abort_before_the_first_chunk_is_a_503_not_a_stream():
    with pytest.raises(APIError) as e:
        run(chat(), [_delta(CompletionDelta(0, finish_reason="abort"), finished=True)])
    assert e.value.status == 503 and e.value.code == "aborted"


def test_an_abort_after_a_chunk_ends_the_stream_with_an_error_event():
    events = run(chat(), [_delta(CompletionDelta(0, "Hi", [1])),
                          _delta(CompletionDelta(0, finish_reason="abort"), finished=True)])
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hi"}
    assert events[1]["choices"][0]["finish_reason"] == "abort"
    assert events[2]["error"]["code"] == "aborted" and events[3] == "[DONE]"


def test_an_engine_error_before_the_first_chunk_is_raised_with_its_status():
    with pytest.raises(APIError) as e:
        run(completion(), [RequestOutOfMemoryError("ran out of memory")])
    assert e.value.status == 500 and e.value.code == "out_of_memory"


def test_an_engine_error_after_a_chunk_is_an_error_event():
    events = run(completion(), [_delta(CompletionDelta(0, "x", [1])), RequestOutOfMemoryError("ran out of memory")])
    assert events[0]["choices"][0]["text"] == "x"
    assert events[1]["error"]["code"] == "out_of_memory" and events[2] == "[DONE]"

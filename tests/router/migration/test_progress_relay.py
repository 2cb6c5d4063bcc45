"""What the client got, read from the upstream's events (token ids taken out), and a continuation's chunks
turned into the client's stream going on (chat deltas, logprobs, usage, one [DONE])."""

from __future__ import annotations

import json

from contract.request import Endpoint
from router.migration.progress import Progress, replica_failed
from router.migration.relay import Relay, final_events
from router.migration.straddle import Straddle


def ev(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def parse(data: bytes) -> list:
    return [e[6:] if e == b"data: [DONE]" else json.loads(e[6:]) for e in data.split(b"\n\n") if e]


HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m"}


def test_progress_records_ids_and_text_and_strips_them():
    p = Progress(Endpoint.CHAT, 1, strip=True)
    first = ev({**HEAD, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}, "logprobs": None,
                                     "finish_reason": None, "token_ids": [10]}], "prompt_token_ids": [1, 2]})
    out = p.feed(first[:20]) + p.feed(first[20:] + ev({**HEAD, "choices": [
        {"index": 0, "delta": {}, "finish_reason": None, "token_ids": [11]}]}))
    assert parse(out) == [{**HEAD, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"},
                                                "logprobs": None, "finish_reason": None}]},
                          {**HEAD, "choices": [{"index": 0, "delta": {}, "finish_reason": None}]}]
    c = p.choices[0]
    assert (c.ids, c.text, c.opened, c.finish, p.prompt_of(c)) == ([10, 11], "Hi", True, None, [1, 2])
    assert p.usage() == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


def test_an_error_event_and_its_done_are_held_back():
    p = Progress(Endpoint.COMPLETIONS, 1, strip=True)
    err = {"error": {"message": "engine died", "type": "service_unavailable", "param": None, "code": "engine_dead"}}
    assert p.feed(ev(err) + b"data: [DONE]\n\n") == b""
    assert p.error == err and not p.done and replica_failed(err)
    assert not replica_failed({"error": {"message": "bad", "type": "invalid_request_error"}})
    assert not replica_failed({"error": {"message": "bad", "type": "BadRequestError", "code": 400}})


def _chat_progress(n: int = 1) -> Progress:
    p = Progress(Endpoint.CHAT, n, strip=True)
    p.feed(ev({**HEAD, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hello"},
                                    "finish_reason": None, "token_ids": [10, 11]}], "prompt_token_ids": [1, 2, 3],
               "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                         "prompt_tokens_details": {"cached_tokens": 0}}}))
    return p


def test_a_chat_continuation_becomes_the_same_streams_chunks():
    p = _chat_progress()
    relay = Relay(p, p.choices[0], None, top_logprobs=1, keep_ids=False, continuous=True)
    lp = {"tokens": [" wor"], "token_logprobs": [-0.5], "top_logprobs": [{" wor": -0.5, " w": -1.5}],
          "text_offset": [0]}
    out = relay.event({"id": "cmpl-9", "object": "text_completion", "choices": [
        {"index": 0, "text": " wor", "logprobs": lp, "finish_reason": None, "token_ids": [12],
         "prompt_token_ids": [1, 2, 3, 10, 11]}]})
    assert out == [{**HEAD, "choices": [{
        "index": 0, "delta": {"content": " wor"}, "finish_reason": None, "stop_reason": None,
        "logprobs": {"content": [{"token": " wor", "logprob": -0.5, "bytes": list(b" wor"),
                                  "top_logprobs": [{"token": " wor", "logprob": -0.5, "bytes": list(b" wor")}]}]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                  "prompt_tokens_details": {"cached_tokens": 0}}}]
    out = relay.event({"choices": [{"index": 0, "text": "ld", "finish_reason": "length", "token_ids": [13]}]})
    assert out[0]["choices"][0]["delta"] == {"content": "ld"} and relay.done
    assert p.choices[0].text == "Hello world" and p.choices[0].ids == [10, 11, 12, 13]
    assert parse(final_events(p, include_usage=True)) == [
        {**HEAD, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                          "prompt_tokens_details": {"cached_tokens": 0}}}, b"[DONE]"]


def test_a_choice_that_had_not_started_gets_its_role():
    p = _chat_progress(n=2)
    relay = Relay(p, p.choices[1], None, top_logprobs=None, keep_ids=False, continuous=False)
    out = relay.event({"choices": [{"index": 0, "text": "Yo", "finish_reason": None, "token_ids": [20]}]})
    assert out[0]["choices"][0]["index"] == 1 and out[0]["choices"][0]["delta"] == {"role": "assistant",
                                                                                     "content": "Yo"}
    assert p.prompt_of(p.choices[1]) == [1, 2, 3]


def test_completions_offsets_go_on_and_a_straddling_stop_ends_the_choice():
    p = Progress(Endpoint.COMPLETIONS, 1, strip=False)
    p.feed(ev({"id": "c", "object": "text_completion", "created": 1, "model": "m", "choices": [
        {"index": 0, "text": "ab", "logprobs": {"tokens": ["ab", "E"], "token_logprobs": [-1, -2],
                                                 "top_logprobs": [{"ab": -1}, {"E": -2}], "text_offset": [0, 2]},
         "finish_reason": None, "token_ids": [5, 6], "prompt_token_ids": [1]}]}))
    c = p.choices[0]
    assert c.next_offset == 3 and c.text == "ab"  # "E" held back by the replica: it may begin "END"
    relay = Relay(p, c, Straddle("E", ("END",), False), top_logprobs=0, keep_ids=True, continuous=False)
    out = relay.event({"choices": [{"index": 0, "text": "ND!", "finish_reason": None, "token_ids": [7],
                                    "logprobs": {"tokens": ["ND"], "token_logprobs": [-3],
                                                 "top_logprobs": [{"ND": -3}], "text_offset": [0]}}]})
    assert out == [{"id": "c", "object": "text_completion", "created": 1, "model": "m", "choices": [
        {"index": 0, "text": "", "finish_reason": "stop", "stop_reason": "END", "token_ids": [7],
         "logprobs": {"tokens": ["ND"], "token_logprobs": [-3], "top_logprobs": [{"ND": -3}], "text_offset": [3]}}]}]
    assert relay.done and c.ids == [5, 6, 7]

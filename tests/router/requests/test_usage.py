"""router/requests/usage.py: usage read from responses, and streamed chunks given back as the client asked."""

from __future__ import annotations

import json

import pytest

from router.requests.usage import StreamUsage, UsageWanted, ask_for_usage, total_tokens


def chunk(text: str | None, usage: dict | None, key_order_usage_last: bool = True) -> bytes:
    obj = {"id": "c1", "object": "text_completion", "choices": [{"index": 0, "text": text}] if text else []}
    if usage is not None or not key_order_usage_last:
        obj["usage"] = usage
    if not key_order_usage_last:
        obj = {"usage": obj.pop("usage"), **obj}
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


U1 = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 0}}
U2 = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}


def test_ask_for_usage_keeps_the_clients_wishes():
    client = {"include_usage": True}
    assert ask_for_usage(client) == (UsageWanted(True, False), {"include_usage": True,
                                                                "continuous_usage_stats": True})
    assert client == {"include_usage": True}  # the client's options are not changed in place
    assert ask_for_usage(None) == (UsageWanted(False, False), {"include_usage": True, "continuous_usage_stats": True})
    assert ask_for_usage(None, continuous=False)[1] == {"include_usage": True, "continuous_usage_stats": False}


@pytest.mark.parametrize("usage_last", [True, False])  # the fast path and the parsing one
@pytest.mark.parametrize("wanted,expect_chunk_usage,expect_final", [
    (UsageWanted(False, False), "absent", False), (UsageWanted(True, False), "null", True),
    (UsageWanted(True, True), "present", True), (UsageWanted(False, True), "present", False),
])
def test_stream_is_given_back_as_asked(usage_last, wanted, expect_chunk_usage, expect_final):
    raw = chunk("a", U1, usage_last) + chunk("b", U2, usage_last) + chunk(None, U2) + b"data: [DONE]\n\n"
    su = StreamUsage(wanted)
    out = b"".join(su.feed(raw[i:i + 7]) for i in range(0, len(raw), 7)) + su.flush()  # split anywhere
    assert su.used == 7
    events = [json.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]
    assert out.endswith(b"data: [DONE]\n\n")
    texts = [e for e in events if e["choices"]]
    assert [e["choices"][0]["text"] for e in texts] == ["a", "b"]
    for e in texts:
        if expect_chunk_usage == "absent":
            assert "usage" not in e
        elif expect_chunk_usage == "null":
            assert e["usage"] is None
        else:
            assert e["usage"] in (U1, U2)
    finals = [e for e in events if not e["choices"]]
    assert finals == ([{"id": "c1", "object": "text_completion", "choices": [], "usage": U2}] if expect_final else [])


def test_body_and_totals():
    su = StreamUsage()
    su.body(json.dumps({"choices": [], "usage": U1}).encode())
    assert su.used == 6
    assert total_tokens({"prompt_tokens": 3, "completion_tokens": 4}) == 7
    assert total_tokens({"total_tokens": True}) is None and total_tokens(None) is None

"""`kvfleet profile` on two hand-written traces: every figure computed by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfleet import profile as prof

DATA = Path(__file__).parent / "data"


def test_our_format_exact():
    p = prof.profile(prof.read_requests(DATA / "tiny_trace.jsonl"))
    # prompt tokens: messages count words + 4 per message: 16, 31, 16, 12, 22; given: 100, 200, 300, 400
    # sorted 12 16 16 22 31 100 200 300 400: p50 = 31, p95 = 300 + 0.6*100, p99 = 300 + 0.92*100
    assert p["prompt_tokens"]["p50"] == 31
    assert p["prompt_tokens"]["p95"] == pytest.approx(360)
    assert p["prompt_tokens"]["p99"] == pytest.approx(392)
    assert p["prompt_tokens"]["mean"] == pytest.approx(1097 / 9)
    assert p["output_tokens"]["p50"] == 50 and p["output_tokens"]["p95"] == pytest.approx(86)
    # conversations: a (2 requests), b, c (2), and 4 session-less requests = 7; multi-turn: a and c
    assert p["conversations"] == 7
    assert p["multi_turn_session_share"] == pytest.approx(2 / 7)
    assert p["follow_up_share"] == pytest.approx(2 / 9)
    # the system prompt "be brief and" starts requests of sessions a and b (3 requests); c's is its own
    assert p["shared_prefix_share"] == pytest.approx(3 / 9)
    assert p["streaming_share"] == pytest.approx(4 / 5)  # 5 requests say, 4 of them stream
    # arrivals 0 1 4 5 8 9 12 13 16: gaps 1,3 x4 -> mean 2, std 1, CV 0.5; 8 gaps over 16 s
    a = p["arrivals"]
    assert a["rate_per_s"] == 0.5 and a["interarrival_cv"] == pytest.approx(0.5) and a["peak_requests_in_1s"] == 1


def test_mooncake_format_exact():
    p = prof.profile(prof.read_requests(DATA / "tiny_mooncake.jsonl"))
    # request 1 extends request 0's [1, 2] (all but its last block), request 4 extends request 1's [1, 2, 7]
    assert p["follow_up_share"] == pytest.approx(2 / 5)
    assert p["conversations"] == 3 and p["multi_turn_session_share"] == pytest.approx(1 / 3)
    # first block 1 starts requests of conversations m0 and m2 (4 requests); block 5 only m3's
    assert p["shared_prefix_share"] == pytest.approx(4 / 5)
    assert p["prompt_tokens"]["p50"] == 1500 and p["prompt_tokens"]["p95"] == pytest.approx(2400)
    assert p["output_tokens"]["mean"] == 210 and p["output_tokens"]["p95"] == pytest.approx(380)
    assert p["streaming_share"] is None
    assert p["arrivals"]["interarrival_cv"] == pytest.approx(1 / 3)
    assert p["arrivals"]["rate_per_s"] == pytest.approx(4 / 6)


def test_json_feeds_capacity(capsys):
    assert prof.main([str(DATA / "tiny_mooncake.jsonl"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    from kvfleet.capacity import lengths_from_profile
    lengths, mean_out = lengths_from_profile(out)
    assert lengths["p50"] == 1700 and mean_out == 210  # 1500 + 200


def test_errors_name_the_input(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "max_tokens": 4}\n')
    assert prof.main([str(bad)]) == 2
    assert "needs messages or prompt_tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        prof.main([])

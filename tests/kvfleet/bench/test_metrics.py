"""Figures from recorded SSE streams (each line with its arrival time) are exact: TTFT, TPOT, ITL,
percentiles, throughput, goodput under an SLO, errors by type; the fleet's /metrics series too."""

from __future__ import annotations

import json

import pytest

from kvfleet.bench.fleet_metrics import Sample, router_replicas, sample_from, summarize_samples
from kvfleet.bench.metrics import Slo, percentile, summarize
from kvfleet.bench.records import RequestRecord, record_from_sse


def chat_stream(times: list[float], pieces: list[str], prompt: int, cached: int = 0) -> list[tuple[float, str]]:
    """A recorded chat stream: a role-only chunk, a keep-alive, one chunk per piece, usage, [DONE]."""
    lines = [(times[0] / 2, 'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}'), (times[0] / 2, ": ka")]
    for t, p in zip(times, pieces, strict=True):
        lines.append((t, "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": p}}]})))
    usage = {"prompt_tokens": prompt, "completion_tokens": len(pieces), "total_tokens": prompt + len(pieces),
             "prompt_tokens_details": {"cached_tokens": cached}}
    lines += [(times[-1], "data: " + json.dumps({"choices": [], "usage": usage})), (times[-1], "data: [DONE]")]
    return lines


def test_record_from_a_recorded_stream():
    r = record_from_sse(chat_stream([0.1, 0.15, 0.25, 0.30], ["a", "b", "c", "d"], 20, 16), scenario="s",
                        start_s=1.0, end_s=0.31)
    assert r.ok and r.ttft_s == 0.1 and r.output_tokens == 4 and r.prompt_tokens == 20 and r.cached_tokens == 16
    assert r.text == "abcd"
    assert r.tpot_s == pytest.approx((0.30 - 0.1) / 3)
    assert r.itl_s == pytest.approx([0.05, 0.10, 0.05])


def test_stream_errors_are_typed():
    err = [(0.1, 'data: {"error": {"message": "boom"}}')]
    assert record_from_sse(err, scenario="s", start_s=0, end_s=0.1).error == "stream_error"
    assert record_from_sse([(0.1, "data: [DONE]")], scenario="s", start_s=0, end_s=0.1).error == "no_tokens"


def test_summary_is_exact():
    recs = [record_from_sse(chat_stream([0.1 * (i + 1), 0.1 * (i + 1) + 0.02, 0.1 * (i + 1) + 0.06], ["x"] * 3, 10),
                            scenario="s", start_s=float(i), end_s=0.1 * (i + 1) + 0.07) for i in range(4)]
    recs.append(RequestRecord("s", 0.5, (), 0.01, error="http_429"))
    recs.append(RequestRecord("s", 0.6, (), 0.01, error="http_429"))
    recs.append(RequestRecord("s", 0.7, (), 2.0, error="timeout"))
    s = summarize(recs, Slo(ttft_ms=250, tpot_ms=40))
    # TTFTs 100, 200, 300, 400 ms: p50 = 250, p95 = 300 + 0.85*100, p99 = 300 + 0.97*100
    assert s["ttft_ms"]["p50"] == pytest.approx(250)
    assert s["ttft_ms"]["p95"] == pytest.approx(385)
    assert s["ttft_ms"]["p99"] == pytest.approx(397)
    # TPOT (0.06 / 2) = 30 ms each; ITL gaps 20 and 40 ms (4 of each): p50 = 30, p99 = 40
    assert s["tpot_ms"]["p50"] == pytest.approx(30)
    assert s["itl_ms"]["p50"] == pytest.approx(30) and s["itl_ms"]["p99"] == pytest.approx(40)
    assert s["e2e_ms"]["mean"] == pytest.approx(320)
    # wall: first send at 0.0, last end at 3.0 + 0.47 = 3.47 (the timeout ends at 0.7 + 2.0)
    assert s["wall_s"] == pytest.approx(3.47)
    assert s["output_tok_s"] == pytest.approx(12 / 3.47) and s["total_tok_s"] == pytest.approx(52 / 3.47)
    # good: TTFT <= 250 ms and TPOT <= 40 ms -> the first two requests
    assert s["good"] == 2 and s["goodput_req_s"] == pytest.approx(2 / 3.47)
    assert s["good_fraction"] == pytest.approx(2 / 7)
    assert s["errors"] == {"http_429": 2, "timeout": 1} and s["failed"] == 3 and s["completed"] == 4


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    xs = [3.0, 1.0, 7.0, 2.0, 9.0, 4.0]
    for q in (0, 50, 90, 95, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_records_round_trip_json():
    r = record_from_sse(chat_stream([0.1, 0.2], ["a", "b"], 5), scenario="s", start_s=0.0, end_s=0.2)
    assert RequestRecord.from_json(json.loads(json.dumps(r.to_json()))) == r


ENGINE = """# HELP x
vllm:kv_cache_usage_perc{model_name="m"} 0.25
vllm:num_requests_running{model_name="m"} 3
vllm:num_requests_waiting{model_name="m"} 1
vllm:prefix_cache_queries_total{model_name="m"} %d
vllm:prefix_cache_hits_total{model_name="m"} %d
"""


def test_fleet_samples_and_hit_rate():
    s0 = sample_from([ENGINE % (100, 10), ENGINE % (100, 30)], 0.0)
    assert s0 == Sample(0.0, 0.25, 6, 2, 200, 40)
    s1 = sample_from([ENGINE % (300, 110), ENGINE % (100, 30)], 1.0)
    s2 = sample_from([ENGINE % (300, 110), ENGINE % (300, 80)], 2.0)
    out = summarize_samples([s0, s1, s2])
    assert out["prefix_hit_rate"] == pytest.approx((190 - 40) / (600 - 200))
    assert [p["hit_rate"] for p in out["series"]] == pytest.approx([0.5, 0.25])
    assert summarize_samples([s0]) is None


def test_router_metrics_name_the_engines():
    text = ('kvfleet_router_replica_ready{replica="http://127.0.0.1:8001"} 1.0\n'
            'kvfleet_router_replica_ready{replica="http://127.0.0.1:8002"} 0.0\n')
    assert router_replicas(text) == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]

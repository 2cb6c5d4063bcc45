"""The guidellm driver's two pure halves: presets as guidellm synthetic data, and its JSON report (the fields
guidellm 0.8.1 writes, as seen in a real run against loadtest/fake_engine.py) read back as kvfleet records."""

from __future__ import annotations

import math

import pytest

from kvfleet.bench.guidellm_driver import records_from_report, synthetic_data
from kvfleet.bench.metrics import summarize


def test_presets_as_synthetic_data():
    assert synthetic_data("long-short", 1.0) == {"kind": "synthetic_text", "prompt_tokens": 1536, "output_tokens": 32}
    assert synthetic_data("multi-turn", 0.5)["turns"] == 4
    assert synthetic_data("shared-system", 1.0) == {"kind": "synthetic_text", "prompt_tokens": 64,
                                                         "output_tokens": 64, "prefix_tokens": 512, "prefix_count": 1}
    assert synthetic_data("rag", 1.0)["prompt_tokens"] == 3 * 160 + 16
    sg = synthetic_data("sharegpt", 1.0)
    assert sg["prompt_tokens_stdev"] == round(256 * math.sqrt(math.e - 1)) and sg["prompt_tokens_max"] == 2048
    with pytest.raises(SystemExit, match="n > 1"):
        synthetic_data("parallel-n", 1.0)


def _req(start: float, first: float, last: float, end: float, n_out: int) -> dict:
    return {"info": {"conversation_id": "c", "turn_index": 0, "error": None,
                     "timings": {"request_start": start, "first_token_iteration": first,
                                 "last_token_iteration": last, "request_end": end}},
            "input_metrics": {"text_tokens": 10, "cached_tokens": 4}, "output_metrics": {"text_tokens": n_out}}


def test_report_to_records():
    report = {"benchmarks": [{"duration": 2.0, "requests": {
        "successful": [_req(100.0, 100.1, 100.5, 100.6, 5), _req(101.0, 101.3, 101.7, 101.8, 5)],
        "errored": [{"info": {"timings": {"request_start": 101.5, "request_end": 101.6},
                              "error": "HTTPStatusError: Client error '429 Too Many Requests'"}}],
        "incomplete": []},
        "metrics": {"inter_token_latency_ms": {"successful": {"mean": 100.0, "percentiles": {
            "p50": 100.0, "p95": 110.0, "p99": 120.0}}}}}]}
    recs, wall, itl = records_from_report(report, "s")
    assert [r.start_s for r in recs] == pytest.approx([0.0, 1.0, 1.5])
    assert recs[0].ttft_s == pytest.approx(0.1) and recs[0].tpot_s == pytest.approx(0.1)
    assert recs[2].error == "http_429" and recs[0].cached_tokens == 4
    s = summarize(recs)
    assert s["ttft_ms"]["p50"] == pytest.approx(200) and s["errors"] == {"http_429": 1}
    assert wall == 2.0 and itl["p99"] == 120.0

"""The usage ledger's records and the usage page a tenant reads (router/tenants/ledger.py): exact, no I/O."""

from __future__ import annotations

from fractions import Fraction

import pytest

from router.tenants.ledger import UsageQueryError, UsageRecord, decimal_text, parse_query, record, usage_page
from router.tenants.pricing import Prices, Usage


def rec(t: float, model: str = "m", key: str | None = "key_a", prompt: int = 10, cached: int = 0, out: int = 2):
    return record(f"req_{t}", "acme", key, model, "p", "http://e1", Usage(prompt, cached, out), prompt + out, None,
                  "200", t, 0.5, 0.1)


def test_a_record_round_trips_and_prices_exactly():
    r = record("req_1", "acme", "key_0123456789abcdef", "smollm2", "stable", "http://e1:8000", Usage(100, 96, 7),
               21, Prices.of("0.10", "0.40", cached_input="0.01"), "200", 1_800_000_000.25, 0.1234567, None)
    assert r.cost_usd == "0.00000416"  # (4 x 0.10 + 96 x 0.01 + 7 x 0.40) / 1e6
    assert UsageRecord.from_json(r.to_json()) == r
    assert (r.prompt_tokens, r.cached_tokens, r.output_tokens, r.budget_tokens) == (100, 96, 7, 21)
    assert record("r", "t", None, "m", "p", None, None, 0, None, "502", 1.0, 0.2, None).cost_usd is None


def test_a_record_keeps_written_tokens_and_cached_tokens_by_tier_and_round_trips():
    u = Usage(1000, 300, 7, 600, (200, 64, 36))
    r = record("req_2", "acme", None, "claude", "stable", "http://e1:8000", u, 887,
               Prices.of("3", "15", cached_input="0.30", cache_write="3.75"), "200", 1_800_000_000.0, 1.0, 0.2)
    assert r.cost_usd == "0.002745"  # (100 x 3 + 600 x 3.75 + 300 x 0.30 + 7 x 15) / 1e6
    assert (r.written_tokens, r.cached_by_tier) == (600, {"device": 200, "lower_tier": 64, "peer": 36})
    assert '"written_tokens":600,"cached_by_tier":{"device":200,"lower_tier":64,"peer":36}' in r.to_json()
    assert UsageRecord.from_json(r.to_json()) == r
    plain = record("req_3", "acme", None, "m", "p", None, Usage(10, 0, 2), 12, None, "200", 1.0, 0.5, None)
    assert (plain.written_tokens, plain.cached_by_tier) == (0, None)
    assert UsageRecord.from_json(plain.to_json()) == plain


def test_a_record_stored_before_written_tokens_and_tiers_still_loads():
    stored = ('{"request_id":"req_1","tenant":"acme","api_key_id":null,"model":"m","pool":"p","replica":null,'
              '"prompt_tokens":10,"cached_tokens":4,"output_tokens":2,"budget_tokens":12,"cost_usd":null,'
              '"outcome":"200","time":1.5,"duration_s":0.5,"ttft_s":null}')
    r = UsageRecord.from_json(stored)
    assert (r.prompt_tokens, r.cached_tokens, r.written_tokens, r.cached_by_tier) == (10, 4, 0, None)
    assert UsageRecord.from_json(r.to_json()) == r


def test_decimal_text_rounds_half_up_at_twelve_places():
    assert decimal_text(Fraction(1, 3)) == "0.333333333333"
    assert decimal_text(Fraction(5, 10**13)) == "0.000000000001" and decimal_text(Fraction(0)) == "0"
    assert decimal_text(Fraction(12, 1)) == "12" and decimal_text(Fraction(-1, 4)) == "-0.25"


def test_usage_page_buckets_every_minute_and_groups():
    records = [rec(60.0), rec(119.9, cached=8), rec(120.0, model="n", key="key_b", out=5), rec(300.0)]
    page = usage_page(records, 60, 240, "1m")
    assert [(b["start_time"], b["end_time"]) for b in page["data"]] == [(60, 120), (120, 180), (180, 240)]
    first = page["data"][0]["results"]
    assert len(first) == 1 and first[0] == {
        "object": "organization.usage.completions.result", "input_tokens": 20, "input_cached_tokens": 8,
        "output_tokens": 4, "num_model_requests": 2, "model": None, "api_key_id": None}
    assert page["data"][2]["results"] == []  # empty buckets are listed
    grouped = usage_page(records, 60, 180, "1m", ("model", "api_key_id"))
    assert [(r["model"], r["api_key_id"], r["num_model_requests"]) for b in grouped["data"] for r in b["results"]] \
        == [("m", "key_a", 2), ("n", "key_b", 1)]
    assert page["has_more"] is False and page["object"] == "page"


def test_query_defaults_and_errors_name_the_parameter():
    assert parse_query({"start_time": ["0"]}, 1000.0) == (0, 1001, "1d", ())
    assert parse_query({"start_time": ["0"], "end_time": ["600"], "bucket_width": ["1m"],
                        "group_by": ["model,api_key_id"]}, 0.0) == (0, 600, "1m", ("model", "api_key_id"))
    for params, param in (({}, "start_time"), ({"start_time": ["x"]}, "start_time"),
                          ({"start_time": ["9"], "end_time": ["9"]}, "end_time"),
                          ({"start_time": ["0"], "bucket_width": ["2h"]}, "bucket_width"),
                          ({"start_time": ["0"], "group_by": ["project_id"]}, "group_by"),
                          ({"start_time": ["0"], "end_time": ["100000"], "bucket_width": ["1m"]}, "end_time")):
        with pytest.raises(UsageQueryError) as e:
            parse_query(params, 0.0)
        assert e.value.param == param

"""`kvfleet usage export`'s writing (router/tenants/usage_export.py): every record field a column, in CSV a missing
value empty and cached tokens by tier its JSON text; no I/O beyond a string."""

from __future__ import annotations

import csv
import io
import json

from router.tenants.ledger import UsageRecord, record
from router.tenants.pricing import Prices, Usage
from router.tenants.usage_export import COLUMNS, write

TIERED = record("req_1", "acme", "key_a", "claude", "p", "http://e1", Usage(1000, 300, 7, 600, (200, 64, 36)), 887,
                Prices.of("3", "15", cached_input="0.30", cache_write="3.75"), "200", 1_800_000_000.0, 1.0, 0.2)
PLAIN = record("req_2", "acme", None, "m", "p", None, Usage(10, 0, 2), 12, None, "502", 1_800_000_001.0, 0.5, None)


def test_csv_columns_are_the_record_fields_and_the_tiers_are_json_text():
    out = io.StringIO()
    write([TIERED, PLAIN], out, "csv")
    rows = list(csv.reader(io.StringIO(out.getvalue())))
    assert rows[0] == COLUMNS and COLUMNS[-2:] == ["written_tokens", "cached_by_tier"]
    tiered, plain = (dict(zip(COLUMNS, r, strict=True)) for r in rows[1:])
    assert (tiered["written_tokens"], tiered["cost_usd"]) == ("600", "0.002745")
    assert tiered["cached_by_tier"] == '{"device":200,"lower_tier":64,"peer":36}'
    assert json.loads(tiered["cached_by_tier"]) == TIERED.cached_by_tier
    assert (plain["written_tokens"], plain["cached_by_tier"], plain["api_key_id"], plain["cost_usd"]) == ("0", "", "",
                                                                                                         "")


def test_json_lines_round_trip_every_record():
    out = io.StringIO()
    write([TIERED, PLAIN], out, "jsonl")
    assert [UsageRecord.from_json(line) for line in out.getvalue().splitlines()] == [TIERED, PLAIN]

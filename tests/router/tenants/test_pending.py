"""router/tenants/pending.py: a pending record, parsed, and what it becomes given its engine's answer; how often
router/tenants/reconcile.py looks for due ones."""

from __future__ import annotations

import json
from fractions import Fraction

from router.tenants import ledger
from router.tenants.pending import ROUTER_LOST_SETTLED, Close, parse
from router.tenants.pending import close as close_
from router.tenants.pricing import Prices

LOST = ledger.record("req_1", "acme", "ab12", "smollm2", "default", None, None, 500, None, ledger.ROUTER_LOST,
                     1000.0, 0.0, None)
PRICES = Prices.of(input="2", output="8", cached_input="0.5")  # dollars per million tokens


def pending(replica: str | None = "http://e1:8000"):
    value = "1010.5 " + (f"{replica} " if replica else "") + LOST.to_json()
    return parse("req_1", value)


def test_parse_with_and_without_a_replica():
    p = pending()
    assert (p.request_id, p.deadline, p.replica, p.record) == ("req_1", 1010.5, "http://e1:8000", LOST)
    assert pending(None).replica is None and pending(None).record == LOST


def test_what_the_engine_says_it_used_is_recorded_priced_and_charged():
    usage = {"prompt_tokens": 120, "cached_tokens": 80, "completion_tokens": 7, "outcome": "aborted"}
    c = close_(pending(), usage, Fraction(1), PRICES, 2000.0, 60.0)
    rec = json.loads(c.record)
    # budget: 40 computed + 80 x 0.25 (cached at a quarter of the input price) + 7 output = 67
    assert (c.request_id, c.reserved, c.used, c.outcome) == ("req_1", 500, 67, ROUTER_LOST_SETTLED)
    assert (rec["prompt_tokens"], rec["cached_tokens"], rec["output_tokens"], rec["budget_tokens"]) == (120, 80, 7, 67)
    assert rec["cost_usd"] == "0.000176"  # (40 x 2 + 80 x 0.5 + 7 x 8) / 1e6
    assert (rec["outcome"], rec["replica"], rec["time"], rec["tenant"]) == (ROUTER_LOST_SETTLED, "http://e1:8000",
                                                                            2000.0, "acme")


WRITE = Prices.of(input="2", output="8", cached_input="0.5", cache_write="2.5")


def test_written_tokens_the_engine_remembers_are_priced_at_cache_write():
    usage = {"prompt_tokens": 120, "cached_tokens": 80, "completion_tokens": 7, "written_tokens": 30,
             "outcome": "stop"}
    c = close_(pending(), usage, Fraction(1), WRITE, 2000.0, 60.0)
    rec = json.loads(c.record)
    # budget: 10 computed + 30 written x 1.25 + 80 x 0.25 + 7 output = 74.5 -> 75
    assert (c.used, rec["budget_tokens"], rec["written_tokens"]) == (75, 75, 30)
    assert rec["cost_usd"] == "0.000191"  # (10 x 2 + 30 x 2.5 + 80 x 0.5 + 7 x 8) / 1e6
    assert close_(pending(), {**usage, "written_tokens": 99}, Fraction(1), WRITE, 2000.0, 60.0).used == 77  # all 40


def test_an_answer_without_written_tokens_is_charged_as_before():
    usage = {"prompt_tokens": 120, "cached_tokens": 80, "completion_tokens": 7, "outcome": "aborted"}
    c = close_(pending(), usage, Fraction(1), WRITE, 2000.0, 60.0)
    rec = json.loads(c.record)
    assert (c.used, rec["written_tokens"], rec["cost_usd"]) == (67, 0, "0.000176")  # as with PRICES, no write


def test_weights_apply_and_the_charge_never_exceeds_the_reservation():
    usage = {"prompt_tokens": 300, "cached_tokens": 0, "completion_tokens": 100, "outcome": "length"}
    assert close_(pending(), usage, Fraction(3, 2), None, 2000.0, 60.0).used == 500  # 600 capped at 500
    usage["completion_tokens"] = 10
    c = close_(pending(), usage, Fraction(3, 2), None, 2000.0, 60.0)
    assert c.used == 465 and json.loads(c.record)["cost_usd"] is None  # ceil(1.5 x 310), no prices


def test_unknown_to_the_engine_keeps_the_reservation_charged():
    c = close_(pending(), "unknown", Fraction(1), PRICES, 2000.0, 60.0)
    assert c == Close("req_1", 500, 500, ledger.UsageRecord(**{**LOST.__dict__, "replica": "http://e1:8000"})
                      .to_json(), ledger.ROUTER_LOST)


def test_never_sent_to_a_replica_is_lost_at_once():
    for answer in (None, "running"):
        c = close_(pending(None), answer, Fraction(1), PRICES, 1011.0, 60.0)
        assert c == Close("req_1", 500, 500, LOST.to_json(), ledger.ROUTER_LOST)


def test_running_or_unreachable_waits_until_the_grace_has_passed():
    for answer in (None, "running"):
        assert close_(pending(), answer, Fraction(1), PRICES, 1070.4, 60.0) is None
        c = close_(pending(), answer, Fraction(1), PRICES, 1070.5, 60.0)
        assert (c.used, c.outcome) == (500, ledger.ROUTER_LOST)


def test_the_cached_tokens_split_by_tier_the_engine_remembers_is_recorded():
    tiers = {"device": 48, "lower_tier": 16, "peer": 16}
    usage = {"prompt_tokens": 120, "cached_tokens": 80, "completion_tokens": 7, "outcome": "stop",
             "cached_tokens_by_tier": tiers}
    rec = json.loads(close_(pending(), usage, Fraction(1), PRICES, 2000.0, 60.0).record)
    assert rec["cached_by_tier"] == tiers and rec["budget_tokens"] == 67  # the split prices nothing differently
    without = json.loads(close_(pending(), {**usage, "cached_tokens_by_tier": {"device": -1}}, Fraction(1), PRICES,
                                2000.0, 60.0).record)
    assert without["cached_by_tier"] is None  # a malformed split (or none: an older engine) is no split


def test_reconcile_rounds_come_every_5_heartbeats_or_sooner_when_records_fall_due_sooner():
    from router.tenants.reconcile import reconcile_every_beats
    assert reconcile_every_beats(2.0, 3600.0) == 5  # the default: ~10 s
    assert reconcile_every_beats(2.0, 6.0) == 3
    assert reconcile_every_beats(2.0, 1.0) == 1  # due after 1 s: every heartbeat
    assert reconcile_every_beats(0.5, 3600.0) == 5

"""router/tenants/budget.py: exact token-bucket arithmetic over injected time (T = 600 tokens/min: C = 600, r = 10/s)."""

from __future__ import annotations

import ast
import pathlib

import pytest

import router.tenants.budget
from router.tenants.budget import (
    CONCURRENCY_RETRY_S,
    Bucket,
    BudgetSpec,
    Denial,
    Leases,
    Quota,
    Reason,
    admit,
)

SPEC = BudgetSpec(600)


def test_spec_capacity_is_one_minute_and_rate_per_second():
    assert (SPEC.capacity, SPEC.rate, SPEC.max_request) == (600.0, 10.0, 600.0)


@pytest.mark.parametrize("kwargs, field", [({"tokens_per_minute": 0}, "tokens_per_minute"),
                                           ({"tokens_per_minute": 60, "max_concurrent_requests": 0},
                                            "max_concurrent_requests"),
                                           ({"tokens_per_minute": 60, "largest_request": 59}, "largest_request")])
def test_spec_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BudgetSpec(**kwargs)


def test_reserve_takes_tokens_until_empty_then_says_when_it_fits():
    b = Bucket.full(SPEC, 0.0)
    b = b.reserve(SPEC, 100, 0.0)
    assert b == Bucket(500.0, 0.0)
    b = b.reserve(SPEC, 500, 0.0)
    assert b == Bucket(0.0, 0.0)
    assert b.reserve(SPEC, 25, 0.0) == Denial(Reason.TOKENS, 2.5)
    assert b.reserve(SPEC, 25, 2.0) == Denial(Reason.TOKENS, 0.5)  # 20 refilled by now
    assert b.reserve(SPEC, 25, 2.5) == Bucket(0.0, 2.5)


def test_denial_leaves_the_bucket_unrefilled():
    b = Bucket(0.0, 0.0)
    assert isinstance(b.reserve(SPEC, 100, 1.0), Denial)
    assert b.refill(SPEC, 1.0) == Bucket(10.0, 1.0)


def test_refill_caps_at_capacity_and_ignores_a_clock_going_back():
    b = Bucket(100.0, 10.0)
    assert b.refill(SPEC, 30.0) == Bucket(300.0, 30.0)
    assert b.refill(SPEC, 1000.0) == Bucket(600.0, 1000.0)
    assert b.refill(SPEC, 5.0) is b
    assert b.refill(SPEC, 10.0) is b


def test_never_fits_is_distinct_from_not_yet():
    full = Bucket.full(SPEC, 0.0)
    assert full.reserve(SPEC, 601, 0.0) == Denial(Reason.TOO_LARGE, None)
    assert Bucket(-1e6, 0.0).reserve(SPEC, 601, 0.0) == Denial(Reason.TOO_LARGE, None)
    assert full.reserve(SPEC, 600, 0.0) == Bucket(0.0, 0.0)
    assert full.reserve(SPEC, 0, 0.0) == full
    with pytest.raises(ValueError):
        full.reserve(SPEC, -1, 0.0)


def test_settle_refunds_the_unused_part():
    b = Bucket.full(SPEC, 0.0).reserve(SPEC, 300, 0.0)
    assert b == Bucket(300.0, 0.0)
    assert b.settle(SPEC, 300, 100, 0.0) == Bucket(500.0, 0.0)
    assert b.settle(SPEC, 300, 300, 0.0) == Bucket(300.0, 0.0)
    assert b.settle(SPEC, 300, 100, 4.0) == Bucket(540.0, 4.0)  # refill 40, then refund 200


def test_settle_refund_never_overfills():
    b = Bucket.full(SPEC, 0.0).reserve(SPEC, 100, 0.0)
    assert b.settle(SPEC, 100, 0, 10.0) == Bucket(600.0, 10.0)  # refilled to 600 already; refund is capped
    assert b.settle(SPEC, 100, 40, 5.0) == Bucket(600.0, 5.0)  # 550 + 60 -> 600


def test_usage_beyond_the_reservation_is_a_debt_that_delays_admission():
    b = Bucket.full(SPEC, 0.0).reserve(SPEC, 100, 0.0)
    b = b.settle(SPEC, 100, 700, 0.0)
    assert b == Bucket(-100.0, 0.0)
    assert b.reserve(SPEC, 50, 0.0) == Denial(Reason.TOKENS, 15.0)
    assert b.reserve(SPEC, 50, 14.0) == Denial(Reason.TOKENS, 1.0)
    assert b.reserve(SPEC, 50, 15.0) == Bucket(0.0, 15.0)
    assert b.reserve(SPEC, 0, 5.0) == Denial(Reason.TOKENS, 5.0)  # even an empty request waits out a debt


def test_reserve_settle_sequence_over_time():
    b = Bucket.full(SPEC, 100.0)
    b = b.reserve(SPEC, 400, 100.0)  # 200
    b = b.reserve(SPEC, 150, 101.0)  # 210 - 150 = 60
    assert b == Bucket(60.0, 101.0)
    b = b.settle(SPEC, 400, 350, 102.5)  # 75 + 50
    assert b == Bucket(125.0, 102.5)
    assert b.reserve(SPEC, 300, 103.0) == Denial(Reason.TOKENS, 17.0)  # 130 now, 170 short
    b = b.settle(SPEC, 150, 150, 120.0)  # 125 + 175
    assert b == Bucket(300.0, 120.0)
    assert b.reserve(SPEC, 300, 120.0) == Bucket(0.0, 120.0)


def test_quota_header_values():
    assert Bucket.full(SPEC, 0.0).quota(SPEC) == Quota(600, 600, 0.0)
    assert Bucket(250.5, 0.0).quota(SPEC) == Quota(600, 250, 34.95)
    assert Bucket(-100.0, 0.0).quota(SPEC) == Quota(600, 0, 70.0)
    assert Bucket(0.75, 0.0).quota(SPEC) == Quota(600, 0, 59.925)


def test_share_divides_the_budget_and_still_admits_a_whole_budget_request_into_debt():
    spec = BudgetSpec(600, max_concurrent_requests=8)
    local = spec.share(3)
    assert local == BudgetSpec(200.0, 2, 600.0)
    assert (local.capacity, local.rate) == (200.0, 600 / 180)
    assert BudgetSpec(600, 1).share(3).max_concurrent_requests == 1
    assert BudgetSpec(600).share(0) == BudgetSpec(600.0, None, 600.0)
    local = BudgetSpec(600).share(2)  # C = 300, r = 5/s
    b = Bucket.full(local, 0.0)
    assert b.reserve(local, 601, 0.0) == Denial(Reason.TOO_LARGE, None)
    b = b.reserve(local, 500, 0.0)
    assert b == Bucket(-200.0, 0.0)
    assert b.reserve(local, 500, 0.0) == Denial(Reason.TOKENS, 100.0)  # needs a full bucket: (300 + 200) / 5
    assert b.reserve(local, 100, 0.0) == Denial(Reason.TOKENS, 60.0)


def test_concurrency_leases():
    spec = BudgetSpec(600, max_concurrent_requests=2)
    b, leases = Bucket.full(spec, 0.0), Leases()
    b, leases = admit(b, leases, spec, 10, 0.0, "a", 30.0)
    b, leases = admit(b, leases, spec, 10, 1.0, "b", 31.0)
    assert leases == Leases((("a", 30.0), ("b", 31.0)))
    assert b == Bucket(590.0, 1.0)
    assert admit(b, leases, spec, 10, 2.0, "c", 32.0) == Denial(Reason.CONCURRENCY, CONCURRENCY_RETRY_S)
    b2, leases2 = admit(b, leases.remove("a"), spec, 10, 2.0, "c", 32.0)
    assert leases2 == Leases((("b", 31.0), ("c", 32.0)))
    assert b2 == Bucket(590.0, 2.0)


def test_expired_leases_stop_counting():
    spec = BudgetSpec(600, max_concurrent_requests=1)
    b, leases = admit(Bucket.full(spec, 0.0), Leases(), spec, 10, 0.0, "a", 30.0)
    assert admit(b, leases, spec, 10, 29.0, "b", 59.0) == Denial(Reason.CONCURRENCY, CONCURRENCY_RETRY_S)
    _, leases = admit(b, leases, spec, 10, 30.0, "b", 60.0)  # expiry <= now: expired
    assert leases == Leases((("b", 60.0),))


def test_token_denial_wins_over_concurrency_and_unlimited_takes_no_lease():
    spec = BudgetSpec(600, max_concurrent_requests=1)
    b, leases = admit(Bucket.full(spec, 0.0), Leases(), spec, 590, 0.0, "a", 30.0)
    assert admit(b, leases, spec, 20, 0.0, "b", 30.0) == Denial(Reason.TOKENS, 1.0)
    unlimited = BudgetSpec(600)
    assert admit(Bucket.full(unlimited, 0.0), Leases(), unlimited, 5, 0.0, "a", 30.0) == \
        (Bucket(595.0, 0.0), Leases())


def test_lease_add_replaces_the_same_id():
    assert Leases().add("a", 1.0).add("a", 2.0) == Leases((("a", 2.0),))
    assert len(Leases().add("a", 1.0).add("b", 2.0).remove("a")) == 1


def test_the_arithmetic_is_pure():
    tree = ast.parse(pathlib.Path(router.tenants.budget.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"__future__", "math", "dataclasses", "fractions", "router.states"}

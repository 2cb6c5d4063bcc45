"""OomBackoff: the token budget halves from the failed step's size and doubles back after good steps; a
request alone in GIVE_UP_AFTER failed steps in a row is given up on, and only then."""

from __future__ import annotations

from engine.oom_backoff import GIVE_UP_AFTER, RECOVER_AFTER, OomBackoff


def test_budget_halves_from_the_failed_step_and_doubles_back_to_the_maximum():
    b = OomBackoff(100)
    assert b.token_budget == 100
    assert b.on_oom(80, {"a", "b"}) is None and b.token_budget == 40
    assert b.on_oom(40, {"a", "b"}) is None and b.token_budget == 20
    for _ in range(RECOVER_AFTER - 1):
        b.on_success()
    assert b.token_budget == 20  # not yet
    b.on_success()
    assert b.token_budget == 40
    for _ in range(3 * RECOVER_AFTER):
        b.on_success()
    assert b.token_budget == 100  # 80, then capped at the maximum


def test_a_failure_restarts_the_count_of_good_steps():
    b = OomBackoff(64)
    b.on_oom(64, {"a", "b"})
    for _ in range(RECOVER_AFTER - 1):
        b.on_success()
    b.on_oom(32, {"a", "b"})
    for _ in range(RECOVER_AFTER - 1):
        b.on_success()
    assert b.token_budget == 16


def test_the_budget_never_drops_below_one_token():
    b = OomBackoff(8)
    b.on_oom(1, {"a", "b"})
    assert b.token_budget == 1


def test_a_request_alone_in_consecutive_failures_is_given_up_on():
    b = OomBackoff(100)
    results = [b.on_oom(n, {"a"}) for n in (50, 25, 12)]
    assert results == [None] * (GIVE_UP_AFTER - 1) + ["a"]
    assert b.on_oom(6, {"a"}) is None  # the count starts over (the engine has ended "a" by now)


def test_a_good_step_or_company_or_another_request_resets_the_count():
    for interruption in ("success", "company", "other"):
        b = OomBackoff(100)
        for _ in range(GIVE_UP_AFTER - 1):
            assert b.on_oom(10, {"a"}) is None
        if interruption == "success":
            b.on_success()
        else:
            assert b.on_oom(10, {"a", "b"} if interruption == "company" else {"b"}) is None
        for _ in range(GIVE_UP_AFTER - 1):
            assert b.on_oom(10, {"a"}) is None
        assert b.on_oom(10, {"a"}) == "a"

"""In-flight prefixes: a prompt routed to a replica counts as held there for ttl_s. Exact."""

from __future__ import annotations

import pytest

from router.routing.inflight_prefixes import InflightPrefixes

A, B = "a", "b"


def test_leading_blocks_routed_count_until_they_expire():
    f = InflightPrefixes(10.0)
    f.record(A, [1, 2, 3], 0.0)
    f.record(B, [1, 2], 5.0)
    assert f.matched_blocks([1, 2, 3, 4], [A, B], 6.0) == {A: 3, B: 2}
    assert f.matched_blocks([9, 2, 3], [A, B], 6.0) == {A: 0, B: 0}  # chained: a different first block
    assert f.matched_blocks([1, 2, 3], [A, B], 12.0) == {A: 0, B: 2}  # A's expired at 10
    f.record(A, [7], 16.0)  # expiry runs on record: A's old entries go, B's (until 15) too
    assert len(f) == 1
    assert f.matched_blocks([1, 2], [A, B], 16.0) == {A: 0, B: 0}


def test_a_newer_route_renews_and_drop_forgets_a_replica():
    f = InflightPrefixes(10.0)
    f.record(A, [1, 2], 0.0)
    f.record(A, [1, 2], 8.0)
    f.record(B, [5], 11.0)  # expires A's first record, not its renewal
    assert f.matched_blocks([1, 2], [A], 11.0) == {A: 2}
    f.drop(A)
    assert f.matched_blocks([1, 2], [A], 11.0) == {A: 0}
    with pytest.raises(ValueError):
        InflightPrefixes(0)

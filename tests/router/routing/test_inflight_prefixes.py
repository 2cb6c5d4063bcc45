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


def test_a_copy_pulled_keeps_its_source_until_it_expires_or_is_computed_there():
    f = InflightPrefixes(10.0)
    f.record(B, [1, 2, 3], 0.0, pull_from=A)
    assert [f.pulling_from(B, h, 1.0) for h in (1, 3, 4)] == [A, A, None]
    assert f.pulling_from(A, 1, 1.0) is None
    f.record(B, [1, 2, 3, 4], 2.0)  # a longer prompt: its shared blocks still come by the pull, the new one not
    assert [f.pulling_from(B, h, 3.0) for h in (3, 4)] == [A, None]
    assert f.pulling_from(B, 1, 12.5) is None  # expired at 12
    f.record(B, [1], 13.0)  # routed there again, to compute: no pull to join
    assert f.pulling_from(B, 1, 13.5) is None
    f.record(B, [5], 14.0, pull_from=A)
    f.drop(A)  # the source left: nothing to join
    assert f.pulling_from(B, 5, 14.5) is None and f.matched_blocks([5], [B], 14.5) == {B: 1}

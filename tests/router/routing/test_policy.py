"""Routing scores and choices on hand-built fleet states, with exact expectations."""

from __future__ import annotations

import random

from router.config import ScoringConfig
from router.routing.policies import (
    POLICIES,
    Decision,
    HashRing,
    IndexKind,
    PolicyNeeds,
    ReplicaView,
    RouteRequest,
)
from router.routing.policies.load import cost, effective_loads, is_overloaded
from router.states import KVEventsState

CFG = ScoringConfig(kv_token_cost=0.5, prefill_weight=1.0, waiting_cost_tokens=256, running_cost_tokens=32,
                    overload_waiting=8, overload_kv_usage=0.95)
A, B, C = "http://a:1", "http://b:1", "http://c:1"
KV, APPROX, SESSION = POLICIES["kv"], POLICIES["approx-prefix"], POLICIES["session"]
LEAST_LOAD, ROUND_ROBIN = POLICIES["least-load"], POLICIES["round-robin"]
NO_RING = HashRing([])
RING = HashRing([A, B, C])  # walks: "user-42" B, C, A; "user-7" C, B, A; "s2" A, B, C


def test_hot_idle_replica_is_chosen():
    views = [ReplicaView(A, cached_tokens=512), ReplicaView(B), ReplicaView(C)]
    d = KV.choose(views, RouteRequest(600), CFG, NO_RING, 0)
    assert (d.url, d.reason, d.predicted_cached_tokens, d.cost) == (A, "cache", 512, 88)


def test_hot_overloaded_replica_yields_to_next_best():
    views = [ReplicaView(A, cached_tokens=512, waiting=8),  # overloaded by its queue
             ReplicaView(B, cached_tokens=256), ReplicaView(C)]
    d = KV.choose(views, RouteRequest(600), CFG, NO_RING, 0)
    assert (d.url, d.reason, d.predicted_cached_tokens) == (B, "cache", 256)
    # requests this router sent since the last scrape count toward the queue too
    views = [ReplicaView(A, cached_tokens=512, waiting=5, new_requests=3), ReplicaView(B, cached_tokens=256)]
    assert KV.choose(views, RouteRequest(600), CFG, NO_RING, 0).url == B
    # and a full KV cache overloads it as well
    views = [ReplicaView(A, cached_tokens=512, kv_usage=0.96), ReplicaView(B, cached_tokens=256)]
    assert KV.choose(views, RouteRequest(600), CFG, NO_RING, 0).url == B


def test_affinity_weighs_saved_prefill_against_load_per_request():
    # A saves 512 tokens and runs 3 requests: 88 + 3 * 32 = 184 < 600 → A
    views = [ReplicaView(A, cached_tokens=512, running=3), ReplicaView(B)]
    d = KV.choose(views, RouteRequest(600), CFG, NO_RING, 0)
    assert (d.url, d.cost) == (A, 184)
    # with 2 waiting ahead: 88 + 2 * 256 = 600, equal to B's 600 → the one holding more of the prompt
    views = [ReplicaView(A, cached_tokens=512, waiting=2), ReplicaView(B)]
    assert [KV.choose(views, RouteRequest(600), CFG, NO_RING, k).url for k in range(2)] == [A, A]
    # with 3 waiting: 88 + 768 = 856 > 600 → B, for this request only
    views = [ReplicaView(A, cached_tokens=512, waiting=3), ReplicaView(B)]
    assert KV.choose(views, RouteRequest(600), CFG, NO_RING, 0).url == B
    # a longer shared prefix still goes to A: 100 + 768 = 868 < 2100
    views = [ReplicaView(A, cached_tokens=2000, waiting=3), ReplicaView(B)]
    assert KV.choose(views, RouteRequest(2100), CFG, NO_RING, 0).url == A
    # uncached tokens of our requests there with no token yet are prefill queued ahead: 88 + 32 + 500 = 620 > 600
    views = [ReplicaView(A, cached_tokens=512, new_requests=1, new_tokens=500, pending=1, pending_tokens=500),
             ReplicaView(B)]
    d = KV.choose(views, RouteRequest(600), CFG, NO_RING, 0)
    assert (d.url, d.cost) == (B, 600)
    # once it streams a token it is only a running request: 88 + 32 = 120 → A
    views = [ReplicaView(A, cached_tokens=512, new_requests=1, new_tokens=500), ReplicaView(B)]
    assert KV.choose(views, RouteRequest(600), CFG, NO_RING, 0).cost == 120


def test_pending_prefill_is_measured_and_waiting_counts_only_what_it_does_not_cover():
    # A: 2 waiting by the scrape, both ours and still without a token (700 uncached tokens between them):
    # 88 + 700 + 0 * 256 = 788; the constant would have said 88 + 2 * 256 = 600
    def a_cost(v: ReplicaView) -> float:
        return cost(v, effective_loads([v])[0], RouteRequest(600), CFG)

    assert a_cost(ReplicaView(A, cached_tokens=512, waiting=2, pending=2, pending_tokens=700)) == 788
    # 3 waiting, 1 of them ours (300 tokens): the 2 others are still a whole unknown prompt each
    assert a_cost(ReplicaView(A, cached_tokens=512, waiting=3, pending=1, pending_tokens=300)) == 88 + 300 + 2 * 256
    # running requests still in prefill (a chunked-prefill engine admits them at once) count their tokens
    views = [ReplicaView(A, cached_tokens=6000, running=4, pending=4, pending_tokens=40_000),
             ReplicaView(B, running=4)]
    d = KV.choose(views, RouteRequest(12_000), CFG, NO_RING, 0)
    assert (d.url, d.cost) == (B, 12_000 + 128)


def test_prefill_weight_counts_the_prefill_a_move_adds_to_the_fleet():
    cfg = ScoringConfig()  # the defaults: prefill_weight 3
    assert cfg.prefill_weight == 3.0
    # a follow-up whose 1000-token history is on A, 2 of our requests queued there (600 tokens):
    # A = 3 * 200 + 600 = 1200; idle B = 3 * 1200 = 3600 → stays on A (weight 1: 800 vs 1200, also A)
    views = [ReplicaView(A, cached_tokens=1000, pending=2, pending_tokens=600, running=0), ReplicaView(B)]
    d = KV.choose(views, RouteRequest(1200), cfg, NO_RING, 0)
    assert (d.url, d.cost) == (A, 1200)
    # with 1500 queued there: weight 1 moves it (200 + 1500 > 1200), weight 3 keeps it (600 + 1500 < 3600)
    views = [ReplicaView(A, cached_tokens=1000, pending=3, pending_tokens=1500), ReplicaView(B)]
    assert KV.choose(views, RouteRequest(1200), CFG, NO_RING, 0).url == B
    assert KV.choose(views, RouteRequest(1200), cfg, NO_RING, 0).url == A
    # but not at any price: 3000 queued ahead outweighs rebuilding the history (600 + 3000 > 3600)
    views = [ReplicaView(A, cached_tokens=1000, pending=4, pending_tokens=3001), ReplicaView(B)]
    assert KV.choose(views, RouteRequest(1200), cfg, NO_RING, 0).url == B


def test_a_long_shared_prefix_does_not_pile_every_session_onto_one_replica():
    # only A holds the 1024-token system prompt, but it is decoding 3 sessions (4500 KV tokens),
    # B one (1500): A = 176 + 0.5 * 4500 + 96 = 2522, B = 1200 + 0.5 * 1500 + 32 = 1982 → B
    views = [ReplicaView(A, cached_tokens=1024, running=3, kv_tokens=4500),
             ReplicaView(B, running=1, kv_tokens=1500)]
    d = KV.choose(views, RouteRequest(1200), CFG, NO_RING, 0)
    assert (d.url, d.cost) == (B, 1982)
    # with one session each, the cached prefix wins: 176 + 750 + 32 < 1200 + 750 + 32
    views = [ReplicaView(A, cached_tokens=1024, running=1, kv_tokens=1500),
             ReplicaView(B, running=1, kv_tokens=1500)]
    assert KV.choose(views, RouteRequest(1200), CFG, NO_RING, 0).url == A
    # unknown load takes the worst fresh KV tokens too
    views = [ReplicaView(A, load_known=False), ReplicaView(B, kv_tokens=800)]
    assert [ld.kv_tokens for ld in effective_loads(views)] == [800, 800]


def test_requests_finished_since_the_scrape_no_longer_count():
    # A's scrape showed 1 running + 3 waiting; 2 of them (ours) finished since: 0 running, 2 waiting left
    views = [ReplicaView(A, cached_tokens=512, running=1, waiting=3, finished=2), ReplicaView(B)]
    loads = effective_loads(views)
    assert (loads[0].running, loads[0].waiting, loads[0].queued) == (0, 2, 2)
    d = KV.choose(views, RouteRequest(700), CFG, NO_RING, 0)
    assert (d.url, d.cost) == (A, 188 + 512)
    assert effective_loads([ReplicaView(A, running=1, finished=3, new_requests=1)])[0].queued == 1


def test_all_cold_goes_to_least_loaded():
    views = [ReplicaView(A, running=2), ReplicaView(B, running=0, waiting=1, kv_usage=0.5),
             ReplicaView(C, running=1, kv_usage=0.2)]
    d = KV.choose(views, RouteRequest(600), CFG, NO_RING, 0)
    assert (d.url, d.reason, d.predicted_cached_tokens) == (C, "least-load", 0)
    assert LEAST_LOAD.choose(views, RouteRequest(600), CFG, NO_RING, 0).url == C


def test_cache_miss_never_goes_to_an_overloaded_replica():
    views = [ReplicaView(A, kv_usage=0.97), ReplicaView(B, running=5)]
    assert KV.choose(views, RouteRequest(600), CFG, NO_RING, 0).url == B
    views = [ReplicaView(A, waiting=9), ReplicaView(B, running=7)]
    assert KV.choose(views, RouteRequest(600), CFG, NO_RING, 0).url == B


def test_all_overloaded_still_answers_with_the_cheapest():
    views = [ReplicaView(A, waiting=9, cached_tokens=512), ReplicaView(B, waiting=8)]
    d = KV.choose(views, RouteRequest(600), CFG, NO_RING, 0)
    assert (d.url, d.reason) == (A, "all-overloaded")


def test_stale_scrape_is_unknown_not_zero():
    # A's scrape is stale: its load counts as the worst fresh load (C's 3), not as zero
    views = [ReplicaView(A, load_known=False), ReplicaView(B, running=1), ReplicaView(C, running=3)]
    assert [ld.queued for ld in effective_loads(views)] == [3, 1, 3]
    assert KV.choose(views, RouteRequest(600), CFG, NO_RING, 0).url == B
    assert LEAST_LOAD.choose(views, RouteRequest(600), CFG, NO_RING, 0).url == B
    # never below what this router itself has in flight there
    views = [ReplicaView(A, load_known=False, inflight=5), ReplicaView(B, running=1)]
    assert [ld.queued for ld in effective_loads(views)] == [5, 1]
    # unknown load alone never makes a replica overloaded; this router's own in-flight count can
    assert not is_overloaded(ReplicaView(A, load_known=False, inflight=7), CFG)
    assert is_overloaded(ReplicaView(A, load_known=False, inflight=8), CFG)


def test_unroutable_replicas_are_skipped_and_none_means_no_choice():
    views = [ReplicaView(A, cached_tokens=512, routable=False), ReplicaView(B)]
    assert KV.choose(views, RouteRequest(600), CFG, NO_RING, 0).url == B
    views = [ReplicaView(A, routable=False)]
    assert KV.choose(views, RouteRequest(600), CFG, NO_RING, 0) is None
    assert LEAST_LOAD.choose(views, RouteRequest(600), CFG, NO_RING, 0) is None
    assert ROUND_ROBIN.choose(views, RouteRequest(600), CFG, NO_RING, 0) is None
    assert SESSION.choose(views, RouteRequest(600, "s"), CFG, HashRing([A]), 0) is None


def test_prediction_never_covers_the_last_prompt_token():
    views = [ReplicaView(A, cached_tokens=64)]
    assert KV.choose(views, RouteRequest(64), CFG, NO_RING, 0).predicted_cached_tokens == 63


def test_round_robin_cycles_in_url_order():
    views = [ReplicaView(C), ReplicaView(A), ReplicaView(B, routable=False)]
    picks = [ROUND_ROBIN.choose(views, RouteRequest(10), CFG, NO_RING, k).url for k in range(4)]
    assert picks == [A, C, A, C]


def test_cache_policy_without_signal_uses_the_session_ring():
    ring = HashRing([A, B, C])
    home = next(ring.walk("user-42"))
    views = [ReplicaView(A), ReplicaView(B), ReplicaView(C)]
    d = KV.choose(views, RouteRequest(600, "user-42"), CFG, ring, 0)
    assert (d.url, d.reason) == (home, "session")
    d = SESSION.choose(views, RouteRequest(600, "user-42"), CFG, ring, 0)
    assert (d.url, d.reason) == (home, "session")
    d = SESSION.choose(views, RouteRequest(600, None), CFG, ring, 0)
    assert d.reason == "least-load"


def _assign(ring: HashRing, urls, keys):
    views = [ReplicaView(u) for u in urls]
    return {k: SESSION.choose(views, RouteRequest(10, k), CFG, ring, 0).url for k in keys}


def test_sessions_stay_put_under_add_and_remove():
    urls = [f"http://10.0.0.{i}:8000" for i in range(1, 6)]
    keys = [f"session-{i}" for i in range(3000)]
    before = _assign(HashRing(urls), urls, keys)
    # every replica owns a fair share (vnodes spread the ring)
    shares = [sum(1 for v in before.values() if v == u) for u in urls]
    assert min(shares) > 3000 / 5 * 0.6, shares
    # removing a replica moves only its own keys
    gone = urls[2]
    after = _assign(HashRing([u for u in urls if u != gone]), [u for u in urls if u != gone], keys)
    moved = [k for k in keys if after[k] != before[k]]
    assert set(moved) == {k for k in keys if before[k] == gone}
    # adding one moves only keys onto the new replica, about 1/6 of them
    new = "http://10.0.0.9:8000"
    grown = _assign(HashRing(urls + [new]), urls + [new], keys)
    moved = [k for k in keys if grown[k] != before[k]]
    assert all(grown[k] == new for k in moved)
    assert 3000 / 6 * 0.5 < len(moved) < 3000 / 6 * 1.5


def test_session_load_is_bounded():
    ring = HashRing([A, B, C])
    key = "hot-session"
    order = list(ring.walk(key))
    assert sorted(order) == [A, B, C]
    # total load 9 → capacity ceil(1.25 * 10 / 3) = 5; the home replica at 5 is full → the next on the walk
    loads = {order[0]: 5, order[1]: 4, order[2]: 0}
    views = [ReplicaView(u, running=loads[u]) for u in (A, B, C)]
    assert SESSION.choose(views, RouteRequest(10, key), CFG, ring, 0).url == order[1]
    loads = {order[0]: 4, order[1]: 5, order[2]: 0}
    views = [ReplicaView(u, running=loads[u]) for u in (A, B, C)]
    assert SESSION.choose(views, RouteRequest(10, key), CFG, ring, 0).url == order[0]


def test_sessions_spread_under_bounded_load():
    """Many concurrent sessions on a ring never push one replica past c * average (+1)."""
    ring = HashRing([A, B, C])
    load = dict.fromkeys((A, B, C), 0)
    rng = random.Random(3)
    for _ in range(300):
        views = [ReplicaView(u, running=load[u]) for u in (A, B, C)]
        d = SESSION.choose(views, RouteRequest(10, f"k{rng.random()}"), CFG, ring, 0)
        load[d.url] += 1
        assert max(load.values()) <= 1.25 * (sum(load.values())) / 3 + 1


def test_ties_rotate_so_equal_replicas_share_sequential_traffic():
    views = [ReplicaView(A), ReplicaView(B), ReplicaView(C, running=1)]
    picks = [KV.choose(views, RouteRequest(100), CFG, NO_RING, k).url for k in range(4)]
    assert picks == [A, B, A, B]
    hot = [ReplicaView(A, cached_tokens=64), ReplicaView(B, cached_tokens=64), ReplicaView(C)]
    assert [KV.choose(hot, RouteRequest(100), CFG, NO_RING, k).url for k in range(2)] == [A, B]


# -- each policy object, exact choices --------------------------------------------------------------------

def test_the_registry_maps_each_name_to_its_object_and_needs():
    assert {name: (p.name, p.needs) for name, p in POLICIES.items()} == {
        "kv": ("kv", PolicyNeeds(kv_events=True, approx_index=True)),
        "approx-prefix": ("approx-prefix", PolicyNeeds(approx_index=True)),
        "session": ("session", PolicyNeeds()),
        "least-load": ("least-load", PolicyNeeds()),
        "round-robin": ("round-robin", PolicyNeeds()),
    }
    assert [p.needs.prompt_tokens for p in POLICIES.values()] == [True, True, False, False, False]


def test_which_index_predicts_a_replica_by_policy_and_kv_event_state():
    states = (KVEventsState.CONNECTING, KVEventsState.LIVE, KVEventsState.UNAVAILABLE)
    table = {name: [p.needs.index_for(s) for s in states] for name, p in POLICIES.items()}
    assert table == {
        "kv": [None, IndexKind.EXACT, IndexKind.APPROX],  # approximate only where a replica has no events
        "approx-prefix": [IndexKind.APPROX] * 3,
        "session": [None] * 3, "least-load": [None] * 3, "round-robin": [None] * 3,
    }


def test_approx_prefix_chooses_exactly_as_kv_on_the_same_predicted_hits():
    cases = [
        ([ReplicaView(A, cached_tokens=512), ReplicaView(B), ReplicaView(C)], RouteRequest(600), 0,
         Decision(A, "cache", 512, 88, prefill=88)),
        ([ReplicaView(A, cached_tokens=512, waiting=8), ReplicaView(B, cached_tokens=256), ReplicaView(C)],
         RouteRequest(600), 0, Decision(B, "cache", 256, 344, prefill=344)),  # the hot replica is overloaded: it yields
        ([ReplicaView(A), ReplicaView(B), ReplicaView(C)], RouteRequest(600, "user-42"), 0,
         Decision(B, "session", 0, 600, prefill=600)),
        ([ReplicaView(A), ReplicaView(B), ReplicaView(C, running=1)], RouteRequest(100), 1,
         Decision(B, "least-load", 0, 100, prefill=100)),  # A and B tie: turn 1 takes the second
        ([ReplicaView(A, waiting=9), ReplicaView(B, waiting=8, cached_tokens=100)], RouteRequest(600), 0,
         Decision(B, "all-overloaded", 100, 2548, prefill=500)),
    ]
    for views, req, turn, expected in cases:
        assert APPROX.choose(views, req, CFG, RING, turn) == expected
        assert KV.choose(views, req, CFG, RING, turn) == expected


def test_session_policy_exact_choices():
    views = [ReplicaView(A), ReplicaView(B), ReplicaView(C)]
    assert SESSION.choose(views, RouteRequest(600, "user-42"), CFG, RING, 0) == Decision(B, "session", 0, 600, prefill=600)
    assert SESSION.choose(views, RouteRequest(600, "user-7"), CFG, RING, 5).url == C  # turn does not matter
    # the home replica is overloaded: the key walks on to the next one on its ring (user-42: B → C)
    views = [ReplicaView(A), ReplicaView(B, waiting=8), ReplicaView(C)]
    assert SESSION.choose(views, RouteRequest(600, "user-42"), CFG, RING, 0).url == C
    # ... or already holds more than its bounded share: total 6, capacity ceil(1.25 * 7 / 3) = 3; B runs 3
    views = [ReplicaView(A, running=1), ReplicaView(B, running=3), ReplicaView(C, running=2)]
    assert SESSION.choose(views, RouteRequest(600, "user-42"), CFG, RING, 0).url == C
    # cached tokens mean nothing to it: the ring decides (s2 → A), yet the prediction is reported
    views = [ReplicaView(A), ReplicaView(B, cached_tokens=512), ReplicaView(C)]
    assert SESSION.choose(views, RouteRequest(600, "s2"), CFG, RING, 0) == Decision(A, "session", 0, 600, prefill=600)
    # no key: least load, ties rotating with the turn
    views = [ReplicaView(A, running=1), ReplicaView(B), ReplicaView(C)]
    assert [SESSION.choose(views, RouteRequest(600), CFG, RING, k).url for k in range(3)] == [B, C, B]
    assert SESSION.choose(views, RouteRequest(600), CFG, RING, 0).reason == "least-load"


def test_least_load_policy_exact_choices():
    # queued, then KV usage, then this router's in-flight count; ties rotate with the turn
    views = [ReplicaView(A, running=2), ReplicaView(B, running=1, kv_usage=0.4), ReplicaView(C, running=1)]
    assert LEAST_LOAD.choose(views, RouteRequest(10), CFG, NO_RING, 0) == Decision(C, "least-load", 0, 42, prefill=10)
    views = [ReplicaView(A, inflight=1), ReplicaView(B), ReplicaView(C)]
    assert [LEAST_LOAD.choose(views, RouteRequest(10), CFG, NO_RING, k).url for k in range(3)] == [B, C, B]
    # cache-blind, and it does not leave out overloaded replicas: the emptiest queue wins
    views = [ReplicaView(A, kv_usage=0.97, cached_tokens=512), ReplicaView(B, running=1)]
    assert LEAST_LOAD.choose(views, RouteRequest(600), CFG, NO_RING, 0).url == A
    assert KV.choose(views, RouteRequest(600), CFG, NO_RING, 0).url == B


def test_round_robin_policy_exact_choices():
    views = [ReplicaView(B, running=9), ReplicaView(C, cached_tokens=64), ReplicaView(A)]
    picks = [ROUND_ROBIN.choose(views, RouteRequest(100), CFG, RING, k) for k in range(4)]
    assert [(d.url, d.reason, d.predicted_cached_tokens) for d in picks] == [
        (A, "round-robin", 0), (B, "round-robin", 0), (C, "round-robin", 64), (A, "round-robin", 0)]
    # load, sessions and overload do not matter; only routability does
    views = [ReplicaView(A, routable=False), ReplicaView(B, waiting=20), ReplicaView(C)]
    assert [ROUND_ROBIN.choose(views, RouteRequest(10, "user-42"), CFG, RING, k).url for k in range(3)] == \
        [B, C, B]


def test_every_configurable_policy_name_has_its_object():
    from router.config import POLICY_NAMES
    from router.routing.policies import POLICIES

    assert tuple(POLICIES) == POLICY_NAMES

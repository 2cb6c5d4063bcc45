"""The placement core (router/routing/placement.py) on hand-built states, with exact expectations: which replica
a request goes to and with what predicted cached tokens, given the replicas' views and both indexes; what
routing a request books and what a finish takes back; membership."""

from __future__ import annotations

import pytest

from contract.hashing import DEFAULT_HASH_SEED
from router.config import ScoringConfig
from router.routing.placement import DEFAULT_POOL, HashedPrompt, Membership, Placement, PlacementConfig
from router.routing.policies import POLICIES
from router.routing.prepare import PreparedRequest
from router.routing.replicas import EngineLoad
from router.states import CircuitState, KVEventsState

A, B, C = "http://a:1", "http://b:1", "http://c:1"
BS, SEED = 4, 0


def _placement(policy: str = "kv", **cfg) -> Placement:
    p = Placement(POLICIES[policy], PlacementConfig(ScoringConfig(), BS, SEED, **cfg))
    p.set_members(DEFAULT_POOL, [A, B, C])
    for r in (A, B, C):
        p.on_health(r, True, 0.0)
    return p


def _prompt(n: int, hashes: tuple[int, ...], session: str | None = None) -> HashedPrompt:
    return HashedPrompt(n, session, BS, SEED, hashes)


def _kv_fleet() -> Placement:
    """A holds 3 blocks of the prompt (1, 2, 3, 4), B 1, by their KV events; C has none: approximate index."""
    p = _placement("kv")
    p.index.reset(A, (1, 2, 3, 9), BS, SEED)
    p.index.reset(B, (1,), BS, SEED)
    p.on_kv_events(A, KVEventsState.LIVE)
    p.on_kv_events(B, KVEventsState.LIVE)
    p.on_kv_events(C, KVEventsState.UNAVAILABLE)
    return p


PROMPT = _prompt(17, (1, 2, 3, 4))  # 17 tokens: 4 cacheable blocks of 4 (never the last token)


def test_predicted_cached_tokens_come_from_the_index_each_replica_is_read_by():
    p = _kv_fleet()
    assert p.predict_cached(PROMPT, [A, B, C]) == {A: 12, B: 4, C: 0}
    p.on_kv_events(B, KVEventsState.CONNECTING)  # its stream resyncs: no prediction for it meanwhile
    assert p.predict_cached(PROMPT, [A, B, C]) == {A: 12, C: 0}
    assert p.predict_cached(_prompt(17, None), [A, B, C]) == {}  # an untokenized prompt: none
    # approx-prefix reads only where requests went, whatever the KV events say
    approx = _placement("approx-prefix")
    approx.index.reset(A, (1, 2, 3), BS, SEED)
    approx.on_kv_events(A, KVEventsState.LIVE)
    assert approx.predict_cached(PROMPT, [A, B]) == {A: 0, B: 0}
    # session and least-load predict nothing
    assert _placement("session").predict_cached(PROMPT, [A, B]) == {}


def test_each_replica_is_matched_with_the_hashes_of_its_own_block_size():
    prep = PreparedRequest(list(range(100)), None, None, False)  # 99 cacheable tokens
    p = Placement(POLICIES["kv"], PlacementConfig(block_size=16))
    p.set_members(DEFAULT_POOL, [A, B])
    p.index.reset(A, prep.block_hashes(16, DEFAULT_HASH_SEED)[:3], 16, DEFAULT_HASH_SEED)
    p.index.reset(B, prep.block_hashes(32, DEFAULT_HASH_SEED)[:2], 32, DEFAULT_HASH_SEED)
    for r in (A, B):
        p.on_kv_events(r, KVEventsState.LIVE)
    assert p.predict_cached(prep, [A, B]) == {A: 48, B: 64}
    # a prompt hashed once (a Ray route hint, a simulated turn) is matched only where the parameters agree
    hint = HashedPrompt(100, None, 16, DEFAULT_HASH_SEED, tuple(prep.block_hashes(16, DEFAULT_HASH_SEED)))
    assert p.predict_cached(hint, [A, B]) == {A: 48}


def test_the_replica_holding_most_of_the_prompt_wins_and_what_routing_it_books():
    p = _kv_fleet()
    d = p.choose(PROMPT, 1.0)
    # no load reading yet (unknown, taken as the fleet's worst: none); cost 3 x uncached: A 15, B 39, C 51
    assert (d.url, d.reason, d.predicted_cached_tokens, d.cost) == (A, "cache", 12, 15.0)
    ticket = p.on_routed(A, PROMPT, d.predicted_cached_tokens, 1.0)
    v = p.replicas[A].view(1.0, 3.0)
    assert (v.inflight, v.new_requests, v.new_tokens, v.pending, v.pending_tokens) == (1, 1, 5, 1, 5)
    assert len(p.approx) == 0 and p.replicas[A].breaker.state(1.0) is CircuitState.CLOSED
    # the same prompt again: A has our 5 tokens of prefill ahead and one more running request (unknown load
    # counts ours): 15 + 5 + 32 = 52 > B's 39
    d2 = p.choose(PROMPT, 1.1)
    assert (d2.url, d2.predicted_cached_tokens, d2.cost) == (B, 4, 39.0)
    p.on_first_token(A, ticket)  # streaming: its prefill is done
    v = p.replicas[A].view(1.1, 3.0)
    assert (v.inflight, v.pending, v.pending_tokens) == (1, 0, 0)
    p.on_done(A, ticket)
    assert p.replicas[A].view(1.1, 3.0).inflight == 0
    # routed to C, which has no KV events: the approximate index learns where the prompt went
    p.on_routed(C, PROMPT, 0, 1.2)
    assert p.predict_cached(PROMPT, [A, B, C]) == {A: 12, B: 4, C: 16}
    assert p.on_routed("http://gone:1", PROMPT, 0, 1.2) is None  # a replica that left: nothing to book


def test_load_and_pending_prefill_move_a_request_off_its_cached_prefix():
    p = _kv_fleet()
    # A is busy: 2 running, 3 waiting (another router's): 15 + 2 * 32 + 3 * 256 = 847; B: 39; C: 51
    p.on_load(A, EngineLoad(kv_usage=0.5, running=2, waiting=3), 5.0, 5.0)
    for r in (B, C):
        p.on_load(r, EngineLoad(), 5.0, 5.0)
    d = p.choose(PROMPT, 5.1)
    assert (d.url, d.reason, d.predicted_cached_tokens, d.cost) == (B, "cache", 4, 39.0)
    # B gets a 41-token request of ours, still in prefill: 39 + 41 + 32 (one more running) = 112 > C's 51
    p.on_routed(B, _prompt(41, ()), 0, 5.2)
    d = p.choose(PROMPT, 5.3)
    assert (d.url, d.predicted_cached_tokens, d.cost) == (C, 0, 51.0)
    # readings older than stale_s (3 s) are unknown load
    assert p.fresh_loads(8.1) == {} and p.fresh_loads(5.1) == {A: EngineLoad(0.5, 2, 3), B: EngineLoad(),
                                                                C: EngineLoad()}


def test_a_finish_comes_off_the_reading_only_if_the_reading_counted_it():
    p = _placement("least-load")
    early = p.on_routed(A, _prompt(8, ()), 0, 9.7)
    late = p.on_routed(A, _prompt(8, ()), 0, 9.9)
    p.on_load(A, EngineLoad(running=2), sent_at=10.0, now=10.05)  # grace 0.2: counts what was sent by 9.8
    v = p.replicas[A].view(10.1, 3.0)
    assert (v.running, v.new_requests, v.inflight) == (2, 1, 2)
    p.on_done(A, late)
    assert p.replicas[A].view(10.1, 3.0).finished == 0
    p.on_done(A, early)
    assert p.replicas[A].view(10.1, 3.0).finished == 1
    # a driver that reads loads whose time it cannot tell (Ray) takes everything sent before as counted
    ray = _placement("least-load", grace_s=0.0)
    t = ray.on_routed(A, _prompt(8, ()), 0, 9.9)
    ray.on_load(A, EngineLoad(running=1), 10.0, 10.0)
    ray.on_done(A, t)
    assert ray.replicas[A].view(10.1, 3.0).finished == 1


def test_ties_rotate_and_the_caller_narrows_the_candidates():
    p = _placement("least-load")
    prompt = _prompt(8, ())
    assert [p.choose(prompt, 1.0).url for _ in range(4)] == [A, B, C, A]
    assert p.turn == 4
    assert {p.choose(prompt, 1.0, excluded={A}).url for _ in range(4)} == {B, C}
    # turns 8 and 9 over the candidates, in their order (a replica outside the pool is left out)
    assert [p.choose(prompt, 1.0, candidates=[C, A, "http://unknown:1"]).url for _ in range(2)] == [C, A]
    assert p.choose(prompt, 1.0, excluded={A, B, C}) is None
    turn = p.turn
    assert p.choose(prompt, 1.0, pool="nope") is None and p.choose(prompt, 1.0, candidates=[]) is None
    assert p.turn == turn  # no decision, no turn


def test_session_keys_stay_on_their_ring_replica():
    p = _placement("session")
    first = p.choose(_prompt(8, (), session="user-42"), 1.0)
    assert first.reason == "session"
    assert {p.choose(_prompt(8, (), session="user-42"), 1.0).url for _ in range(5)} == {first.url}


def test_membership_readiness_and_pools():
    p = Placement(POLICIES["approx-prefix"], PlacementConfig(block_size=BS, hash_seed=SEED))
    assert p.set_members("one", [A, B, A]) == Membership(joined=(A, B))
    assert p.ready_urls(0.0) == []  # not ready until a readiness check says so
    assert p.on_health(A, True, 0.0) and not p.on_health(A, True, 0.0)
    assert p.ready_urls(0.0) == [A] and p.choose(_prompt(8, ()), 0.0, "one").url == A
    assert p.set_members("two", [B, C]) == Membership(joined=(C,), elsewhere=(B,))  # B stays in "one"
    assert (p.members, p.pool_of) == ({"one": [A, B], "two": [C]}, {A: "one", B: "one", C: "two"})
    p.on_routed(B, _prompt(9, (7, 8)), 0, 1.0)
    assert p.approx.matched_blocks((7, 8), [B]) == {B: 2}
    assert p.set_members("one", [A]) == Membership(left=(B,))
    assert B not in p.replicas and p.approx.matched_blocks((7, 8), [B]) == {B: 0}
    assert p.set_members("two", [B, C]) == Membership(joined=(B,))
    assert p.drop_pool("two") == Membership(left=(B, C)) and set(p.replicas) == {A} and "two" not in p.rings
    p.remove(A)
    assert p.replicas == {} and p.members == {"one": []}
    # a replica whose circuit opened gets traffic again at once when it comes back
    q = _placement("least-load", breaker_failures=1)
    q.replicas[A].breaker.on_failure(1.0)
    assert q.on_health(A, False, 1.0) and q.on_health(A, True, 2.0)
    assert q.replicas[A].breaker.state(2.0) is CircuitState.CLOSED


def test_configuration_errors_name_the_field():
    with pytest.raises(ValueError, match="block_size"):
        PlacementConfig(block_size=0)
    with pytest.raises(ValueError, match="grace_s"):
        PlacementConfig(grace_s=-1)

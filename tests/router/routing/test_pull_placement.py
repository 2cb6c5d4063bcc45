"""Peer pulls in the placement core (issue 31): where a peer holds more of the prompt than the chosen replica,
the score counts that part at its transfer cost instead of its prefill, so a busy holder no longer wins by its
cache alone; the decision names the peer and the tokens to pull. Exact."""

from __future__ import annotations

import pytest

from contract.hashing import hash_blocks
from router.config import ScoringConfig
from router.routing.placement import DEFAULT_POOL, Placement, PlacementConfig
from router.routing.policies import POLICIES
from router.routing.prepare import PreparedRequest
from router.routing.replicas import EngineLoad
from router.states import KVEventsState

A, B = "http://a:1", "http://b:1"
BS, SEED = 4, 0
TOKENS = list(range(17))  # 4 full blocks: 16 cacheable tokens
CHEAP = ScoringConfig(pull_token_cost=0.1, pull_fixed_tokens=1.0)


def _placement(scoring: ScoringConfig) -> Placement:
    p = Placement(POLICIES["kv"], PlacementConfig(scoring, BS, SEED))
    p.set_members(DEFAULT_POOL, [A, B])
    for r in (A, B):
        p.on_health(r, True, 0.0)
        p.on_kv_events(r, KVEventsState.LIVE)
        p.index.reset(r, (), BS, SEED)
    p.index.reset(A, tuple(hash_blocks(TOKENS[:16], BS, None, SEED)), BS, SEED)  # A holds the whole prefix
    p.on_load(A, EngineLoad(running=10), 0.0, 0.0)  # A is busy: 10 running requests, 320 tokens of load
    p.on_load(B, EngineLoad(), 0.0, 0.0)
    return p


def _request() -> PreparedRequest:
    return PreparedRequest(list(TOKENS), None, None, False)


def test_a_cheap_pull_sends_the_request_to_the_idle_replica_with_the_holder_as_source():
    d = _placement(CHEAP).choose(_request(), 0.0)
    assert (d.url, d.pull_from, d.pull_tokens, d.predicted_cached_tokens) == (B, A, 16, 16)
    assert d.cost == 3 * 1 + 1.0 + 0.1 * 16  # 1 uncached token, the pull's set-up and 16 tokens' transfer


def test_without_pulls_the_idle_replica_recomputes_and_a_dear_pull_is_not_taken():
    d = _placement(ScoringConfig()).choose(_request(), 0.0)  # A: 3 * 1 + 320; B: 3 * 17, every token computed
    assert (d.url, d.pull_from, d.pull_tokens, d.predicted_cached_tokens) == (B, None, 0, 0) and d.cost == 3 * 17
    p = _placement(ScoringConfig(pull_token_cost=0.9, pull_fixed_tokens=2.0))  # 2 + 14.4 >= 16: recompute
    d = p.choose(_request(), 0.0)
    assert (d.url, d.pull_from, d.pull_tokens, d.predicted_cached_tokens) == (B, None, 0, 0)
    idle = _placement(CHEAP)
    idle.on_load(A, EngineLoad(), 0.0, 0.0)
    d = idle.choose(_request(), 0.0)
    assert (d.url, d.pull_from, d.pull_tokens, d.predicted_cached_tokens) == (A, None, 0, 16)  # the holder itself


def test_no_pull_from_a_replica_that_is_not_ready():
    p = _placement(CHEAP)
    p.on_health(A, False, 0.0)
    d = p.choose(_request(), 0.0)
    assert (d.url, d.pull_from, d.pull_tokens, d.predicted_cached_tokens) == (B, None, 0, 0)


def _empty(scoring: ScoringConfig, inflight_s: float) -> Placement:
    """Two idle replicas whose caches hold nothing."""
    p = Placement(POLICIES["kv"], PlacementConfig(scoring, BS, SEED, inflight_s=inflight_s))
    p.set_members(DEFAULT_POOL, [A, B])
    for r in (A, B):
        p.on_health(r, True, 0.0)
        p.on_kv_events(r, KVEventsState.LIVE)
        p.index.reset(r, (), BS, SEED)
        p.on_load(r, EngineLoad(), 0.0, 0.0)
    return p


def test_a_burst_on_a_new_prompt_pulls_from_the_replica_it_was_first_routed_to():
    """Nobody holds the prompt yet; the first request goes to one replica, and with in-flight prefixes on the next
    one counts it held there (its prefill is computing it): the other replica takes it and pulls from the first."""
    p = _empty(CHEAP, 30.0)
    first = p.choose(_request(), 1.0)
    assert (first.pull_from, first.predicted_cached_tokens) == (None, 0)
    p.on_routed(first.url, _request(), first.predicted_cached_tokens, 1.0)
    second = p.choose(_request(), 1.1)
    other = B if first.url == A else A
    assert (second.url, second.pull_from, second.pull_tokens) == (other, first.url, 16)
    p.on_routed(second.url, _request(), second.predicted_cached_tokens, 1.1)
    late = p.choose(_request(), 40.0)  # past inflight_s, and no KV event said either holds it: nothing to pull
    assert late.pull_from is None and late.predicted_cached_tokens == 0


def test_a_pull_from_a_source_still_computing_costs_the_longer_of_its_prefill_and_the_transfer():
    """The source streams the blocks as its prefill computes them, so the transfer overlaps that prefill: the pull
    costs its set-up plus whichever takes longer, not both (which kept bursts on the computing replica)."""
    p = _empty(CHEAP, 30.0)
    p.on_routed(A, _request(), 0, 1.0)  # A computes all 17 tokens: 17 pending there, 1 request running
    d = p.choose(_request(), 1.1)  # B: 3 * 1 uncached + 1.0 + max(0.1 * 16, 17); A: 3 * 1 + 17 pending + 32 * 1
    assert (d.url, d.pull_from, d.pull_tokens, d.pull_pending, d.cost) == (B, A, 16, True, 3 + 1.0 + 17)
    slow = _empty(ScoringConfig(pull_token_cost=0.5, pull_fixed_tokens=1.0), 30.0)
    slow.on_routed(A, PreparedRequest([*TOKENS[:16], 99], None, None, False), 16, 1.0)  # 1 token pending on A
    assert slow.choose(_request(), 1.1).cost == 3 + 1.0 + 0.5 * 16  # the transfer is the longer


def test_requests_following_a_pull_on_its_way_carry_the_same_pull():
    """The burst's next requests on the pulling replica carry its pull too (they may reach the engine before the
    request that pulls, and one that found neither the blocks nor a pull in flight there would compute them all)
    and are priced with its wait for the source's prefill (else the pulling replica looked like a free cache hit).
    A request routed there to compute, not pull, ends that; without pulls nobody joins anything."""
    p = _empty(CHEAP, 30.0)
    p.on_routed(A, _request(), 0, 1.0)  # A computes it
    p.on_load(A, EngineLoad(running=10), 0.0, 1.0)  # and is busy: the next ones go to B
    second = p.choose(_request(), 1.1)
    assert (second.url, second.pull_from, second.pull_tokens, second.pull_pending) == (B, A, 16, True)
    p.on_routed(B, _request(), second.predicted_cached_tokens, 1.1, second.pull_from)
    third = p.choose(_request(), 1.2)  # B's copy is on its way from A: no new transfer counted, the same pull
    assert (third.url, third.pull_from, third.pull_tokens, third.pull_pending) == (B, A, 0, True)
    assert third.predicted_cached_tokens == 16
    assert third.cost == 3 * 1 + 17 + 1 + 32 * 1  # it waits for A's prefill (17) as the pull does, behind B's own
    p.index.reset(A, tuple(hash_blocks(TOKENS[:16], BS, None, SEED)), BS, SEED)  # A's KV events: computed
    assert p.choose(_request(), 1.3).pull_pending is False  # the source holds it: no need to wait for it
    p.on_routed(B, _request(), 16, 45.0)  # later, expired and routed to B to compute: no pull to join
    assert p.choose(_request(), 45.1).pull_from is None
    off = _empty(ScoringConfig(), 30.0)
    off.on_routed(B, _request(), 0, 1.0, A)
    assert off.choose(_request(), 1.1).pull_from is None


def test_in_flight_prefixes_count_with_or_without_pulls_and_are_off_without_inflight_s():
    """Without pulls a burst on a new prompt stays with the replica computing it while load allows (the second
    request's cost there is its queue, not a recompute); inflight_s 0 turns the prediction off."""
    for scoring in (ScoringConfig(), CHEAP):
        p = _empty(scoring, 30.0)
        p.on_routed(A, _request(), 0, 1.0)
        assert p.predict_cached(_request(), [A, B], 1.1) == {A: len(TOKENS) // BS * BS, B: 0}
    p = _empty(CHEAP, 0.0)
    p.on_routed(A, _request(), 0, 1.0)
    assert p.predict_cached(_request(), [A, B], 1.1) == {A: 0, B: 0}


def test_blocks_a_lower_tier_holds_count_at_their_reload_cost():
    """B's KV cache holds the first block, its lower tier the next three: a reload at 0.1 per token, not a prefill;
    the tier's blocks come and go with events of their medium, and a snapshot's tiers restore them."""
    p = _empty(ScoringConfig(tier_token_cost=0.1), 0.0)
    hashes = hash_blocks(TOKENS[:16], BS, None, SEED)
    p.index.reset(B, hashes[:1], BS, SEED, tier_hashes=hashes[1:])
    d = p.choose(_request(), 0.0)
    assert (d.url, d.predicted_cached_tokens) == (B, 16)
    assert d.cost == 3 * 1 + 0.1 * 12  # the last token computed, 12 tokens reloaded
    p.index.remove(B, hashes[2:3], "DISK")  # the tier let block 2 go: only block 1 reloads
    d = p.choose(_request(), 0.0)
    assert (d.url, d.predicted_cached_tokens) == (B, 8) and d.cost == 3 * 9 + 0.1 * 4
    p.index.clear(B)
    assert p.index.tier_run(hashes, B, 0) == 0


def test_pulls_are_on_by_default_measured_and_off_for_vllm_or_sglang_engines():
    from router.main import build_parser, config_from_args

    def scoring(*argv: str) -> ScoringConfig:
        return config_from_args(build_parser().parse_args(["--replicas", "http://a:1", *argv])).scoring

    default = scoring()
    assert (default.pull_token_cost, default.pull_cost_measured) == (0.05, True)
    for kind in ("vllm", "sglang"):
        off = scoring("--engine-type", kind)
        assert (off.pull_token_cost, off.pull_cost_measured) == (0.0, False)
    assert (scoring("--pull-token-cost", "0").pull_token_cost, scoring("--pull-token-cost", "0").pull_cost_measured) \
        == (0.0, False)


def test_a_replica_whose_metrics_say_vllm_neither_serves_nor_takes_a_pull():
    p = _placement(CHEAP)
    p.replicas[A].engine = "vllm"  # the holder cannot serve a pull: B recomputes, or A keeps it
    d = p.choose(_request(), 0.0)
    assert (d.pull_from, d.pull_tokens) == (None, 0)
    p = _placement(CHEAP)
    p.replicas[B].engine = "sglang"  # the idle replica cannot take one
    d = p.choose(_request(), 0.0)
    assert (d.pull_from, d.pull_tokens) == (None, 0)
    p = _placement(CHEAP)
    p.replicas[A].engine = p.replicas[B].engine = "kvfleet"
    assert p.choose(_request(), 0.0).pull_from == A


def _fitted(scoring: ScoringConfig) -> Placement:
    """_placement with the TTFT model set by hand: 10 ms + 1 ms per prompt token of work + 2 ms per running sequence."""
    p = _placement(scoring)
    p.ttft.coefficients = (0.01, 0.001, 0.0, 0.0, 0.002, 0.0, 0.0)
    return p


def test_a_pull_lowers_the_predicted_ttft_as_a_cached_prefix_does():
    """The TTFT model takes the prompt work the policy costs: on B, 1 token computed and 16 pulled at 0.1 token
    each plus 1 token's set-up, 3.6 tokens of work, not 17; A's cache hit leaves 1 token but 10 running."""
    pulls = _fitted(CHEAP).predict_ttft(_request(), 0.0)
    assert pulls == pytest.approx({A: 0.01 + 0.001 * 1 + 0.002 * 10, B: 0.01 + 0.001 * (1 + 1.0 + 0.1 * 16)})
    without = _fitted(ScoringConfig()).predict_ttft(_request(), 0.0)
    assert without == pytest.approx({A: 0.031, B: 0.01 + 0.001 * 17})  # B computes all 17
    dear = _fitted(ScoringConfig(pull_token_cost=0.9, pull_fixed_tokens=2.0)).predict_ttft(_request(), 0.0)
    assert dear == without  # a pull dearer than the prefill is not taken, nor counted


def test_a_ttft_target_only_a_pull_can_meet_is_met_and_the_ticket_learns_the_work_it_was_predicted_with():
    targeted = PreparedRequest(list(TOKENS), None, None, False, ttft_target_s=0.02)  # B: 13.6 ms pulling, 27 ms computing
    assert _fitted(ScoringConfig()).unattainable(targeted, 0.0) is not None  # without pulls: refused
    p = _fitted(CHEAP)
    assert p.unattainable(targeted, 0.0) is None
    d = p.choose(targeted, 0.0)
    assert (d.url, d.pull_from, d.prefill) == (B, A, pytest.approx(3.6))
    ticket = p.on_routed(d.url, targeted, d.predicted_cached_tokens, 0.0, d.pull_from, d.prefill)
    assert ticket.ttft_features.prompt_tokens == pytest.approx(3.6)
    assert ticket.predicted_ttft_s == pytest.approx(0.0136)
    assert ticket.tokens == 1  # only the uncached token is prefill ahead on B

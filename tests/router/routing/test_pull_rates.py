"""The pull cost measured from the engines' rates (--pull-token-cost auto). Exact."""

from __future__ import annotations

import pytest

from contract.hashing import hash_blocks
from router.config import ScoringConfig
from router.routing.placement import DEFAULT_POOL, Placement, PlacementConfig
from router.routing.policies import POLICIES
from router.routing.prepare import PreparedRequest
from router.routing.pull_rates import PullRates
from router.routing.replicas import EngineLoad, parse_engine_metrics
from router.states import KVEventsState


def load(prefill_s: float, prefill_tokens: float, pull_s: float, pulled: float) -> EngineLoad:
    return EngineLoad(prefill_seconds=prefill_s, prefill_tokens=prefill_tokens, pull_seconds=pull_s,
                      pulled_tokens=pulled)


def test_the_cost_is_pull_seconds_per_token_over_prefill_seconds_per_token_once_both_are_known():
    r = PullRates(min_tokens=1000)
    r.on_load("a", load(0, 0, 0, 0), 0.0)  # the first reading of a replica only sets its baseline
    assert r.cost(0.05) == 0.05
    r.on_load("a", load(2.0, 1000, 0, 0), 0.0)  # 2 ms per prefilled token; nothing pulled yet
    assert r.cost(0.05) == 0.05
    r.on_load("b", load(10, 10, 10, 10), 0.0)
    r.on_load("b", load(10, 10, 10.04, 1010), 0.0)  # 0.04 ms per pulled token
    assert r.cost(0.05) == pytest.approx(0.02)
    r.on_load("b", load(0, 0, 0, 0), 0.0)  # b restarted: a new baseline, nothing subtracted
    assert r.cost(0.05) == pytest.approx(0.02)


def test_older_readings_fade():
    r = PullRates(half_life_s=10.0, min_tokens=1)
    r.on_load("a", load(0, 0, 0, 0), 0.0)
    r.on_load("a", load(1, 100, 1, 100), 0.0)
    r.on_load("a", load(2, 200, 1.5, 200), 10.0)  # pulls got twice as fast, one half-life later: half the old weight
    assert r.pull_s == 0.5 * 1 + 0.5 and r.pulled_tokens == 0.5 * 100 + 100


def test_the_engines_counters_are_parsed():
    text = ('kvfleet:prefill_seconds_total{model_name="m"} 3.5\nkvfleet:prefill_computed_tokens_total{model_name="m"}'
            ' 2000.0\nkvfleet:kv_pull_transfer_seconds_total{model_name="m"} 0.25\n'
            'kvfleet:kv_pulled_tokens_total{model_name="m"} 4096.0\n')
    got = parse_engine_metrics(text)
    assert (got.prefill_seconds, got.prefill_tokens, got.pull_seconds, got.pulled_tokens) == (3.5, 2000, 0.25, 4096)


def test_placement_routes_with_the_measured_cost():
    """A holds the prompt and is busy; B is idle. At the prior (1.0 per token) a pull costs as much as the prefill
    it saves and B recomputes; once the engines measure pulls at 0.01 of a prefill, B pulls."""
    bs, seed, tokens = 4, 0, list(range(17))
    p = Placement(POLICIES["kv"], PlacementConfig(ScoringConfig(pull_token_cost=1.0, pull_cost_measured=True),
                                                  bs, seed))
    p.set_members(DEFAULT_POOL, ["a", "b"])
    for r in ("a", "b"):
        p.on_health(r, True, 0.0)
        p.on_kv_events(r, KVEventsState.LIVE)
        p.index.reset(r, (), bs, seed)
    p.index.reset("a", tuple(hash_blocks(tokens[:16], bs, None, seed)), bs, seed)
    p.on_load("a", EngineLoad(running=10), 0.0, 0.0)
    p.on_load("b", EngineLoad(), 0.0, 0.0)
    req = PreparedRequest(list(tokens), None, None, False)
    assert p.choose(req, 0.0).pull_from is None
    p.on_load("a", EngineLoad(running=10, prefill_seconds=4.0, prefill_tokens=2048), 0.0, 0.0)
    p.on_load("b", EngineLoad(pull_seconds=0.04, pulled_tokens=2048), 0.0, 0.0)
    assert p.pull_rates.cost(1.0) == pytest.approx(0.01)
    d = p.choose(req, 0.0)
    assert (d.url, d.pull_from, d.reason) == ("b", "a", "cache")

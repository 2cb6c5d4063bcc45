"""LoRA adapters in the placement core: a request's adapter keys its block hashes (as the engines do), replicas
learn which adapters they hold from /v1/models, and one score weighs prefix hits, load and an adapter load
where the adapter is missing (router/routing/policies/load.py): the holder wins, unless it is busier than
a load costs (a hot adapter spreads); a peek does not advance the turn."""

from __future__ import annotations

from contract.hashing import hash_blocks
from router.config import ScoringConfig
from router.routing.adapters import request_adapter
from router.routing.placement import DEFAULT_POOL, Placement, PlacementConfig
from router.routing.policies import POLICIES
from router.routing.policies.load import ADAPTER_LOAD_COST_TOKENS
from router.routing.prepare import PreparedRequest
from router.routing.replicas import EngineLoad
from router.states import KVEventsState

A, B = "http://a:1", "http://b:1"
BS, SEED = 4, 0


def _placement(policy: str = "kv") -> Placement:
    p = Placement(POLICIES[policy], PlacementConfig(ScoringConfig(), BS, SEED))
    p.set_members(DEFAULT_POOL, [A, B])
    for r in (A, B):
        p.on_health(r, True, 0.0)
        p.on_kv_events(r, KVEventsState.LIVE)
        p.index.reset(r, (), BS, SEED)
    return p


def _request(adapter: str | None, tokens=tuple(range(17))) -> PreparedRequest:
    prep = PreparedRequest(list(tokens), None, None, False)
    prep.adapter = adapter
    return prep


def test_block_hashes_carry_the_adapter():
    tokens = list(range(17))
    assert _request("sql").block_hashes(BS, SEED) == hash_blocks(tokens[:16], BS, None, SEED, adapter="sql")
    assert _request(None).block_hashes(BS, SEED) == hash_blocks(tokens[:16], BS, None, SEED)
    p = _placement()
    p.index.reset(A, tuple(hash_blocks(tokens[:16], BS, None, SEED)), BS, SEED)  # A cached the base model's
    assert p.predict_cached(_request("sql"), [A, B]) == {A: 0, B: 0}
    assert p.predict_cached(_request(None), [A, B]) == {A: 16, B: 0}


def test_adapters_are_learned_from_the_models_list():
    p = _placement()
    assert p.on_models(A, frozenset({"smollm2", "sql"}), frozenset({"sql"}))
    assert not p.on_models(A, frozenset({"smollm2", "sql"}), frozenset({"sql"}))
    assert p.is_adapter("sql") and not p.is_adapter("smollm2")
    assert p.holders(DEFAULT_POOL, "sql") == [A]
    assert request_adapter("sql", {}, p) == "sql" and request_adapter("smollm2", {}, p) is None
    assert request_adapter("cold", {"cold": "/a/cold"}, p) == "cold"  # on demand: known by the pools file
    p.on_adapter_loaded(B, "cold")
    assert p.holders(DEFAULT_POOL, "cold") == [B] and p.is_adapter("cold")


def test_one_score_prefers_the_holder_until_it_is_busier_than_a_load():
    p = _placement()
    p.on_models(A, frozenset({"smollm2", "sql"}), frozenset({"sql"}))
    p.on_models(B, frozenset({"smollm2"}), frozenset())
    req = _request("sql")
    for _turn in range(4):  # ties rotate by turn: the holder wins every time
        assert p.choose(req, 0.0).url == A
    views = {v.url: v for v in p.views(req, [A, B], 0.0)}
    assert not views[A].adapter_missing and views[B].adapter_missing
    cfg = ScoringConfig()
    busy = int(ADAPTER_LOAD_COST_TOKENS / cfg.running_cost_tokens) + 1  # more running requests than a load costs
    p.on_load(A, EngineLoad(running=busy), 0.0, 0.0)
    p.on_load(B, EngineLoad(), 0.0, 0.0)
    assert p.choose(req, 0.0).url == B  # the hot adapter spreads to B (loaded there on demand)
    assert p.choose(_request(None), 0.0).url == B  # the base model never pays for an adapter


def test_a_peek_does_not_advance_the_turn():
    p = _placement("round-robin")
    first = p.choose(_request(None), 0.0, peek=True).url
    assert p.choose(_request(None), 0.0).url == first
    assert p.choose(_request(None), 0.0).url != first

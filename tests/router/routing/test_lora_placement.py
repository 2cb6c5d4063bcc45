"""LoRA adapters in the placement core: a request's adapter keys its block hashes (as the engines do), replicas
learn which adapters they hold from /v1/models and from vllm:lora_requests_info, and one score weighs prefix hits, load and an adapter load
where the adapter is missing (router/routing/policies/load.py): the holder wins, unless it is busier than
a load costs (a hot adapter spreads); a peek does not advance the turn."""

from __future__ import annotations

from contract.hashing import hash_blocks
from router.config import ScoringConfig
from router.routing.adapters import request_adapter
from router.routing.placement import DEFAULT_POOL, Placement, PlacementConfig
from router.routing.policies import POLICIES
from router.routing.policies.load import ADAPTER_LOAD_COST_TOKENS, ADAPTER_SLOT_WAIT_COST_TOKENS
from router.routing.prepare import PreparedRequest
from router.routing.replicas import EngineLoad, LoRAInfo, parse_engine_metrics
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


# vLLM's gauge keeps one series per label set it has seen, each valued at the time it was set: the latest counts
VLLM_LORA_METRICS = """\
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql",waiting_lora_adapters=""} 1.7648e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql,chat",waiting_lora_adapters="math"} 1.7649e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7647e+09
vllm:num_requests_running{engine="0",model_name="smollm2"} 3.0
"""


def test_lora_requests_info_is_read_latest_sample_first():
    load = parse_engine_metrics(VLLM_LORA_METRICS)
    assert load.lora == LoRAInfo(frozenset({"sql", "chat"}), frozenset({"math"}), 2)
    assert load.running == 3 and load.engine == "vllm"
    assert load.lora.slots_full_without("math") and not load.lora.slots_full_without("sql")
    assert parse_engine_metrics("vllm:num_requests_running 1\n").lora is None  # LoRA off: no gauge


def test_the_metric_tells_holders_between_models_lists_and_full_slots_cost_a_wait():
    p = _placement()
    for r in (A, B):
        p.on_models(r, frozenset({"smollm2"}), frozenset())  # listed before any adapter was loaded
    p.on_load(A, parse_engine_metrics(VLLM_LORA_METRICS), 0.0, 0.0)
    p.on_load(B, EngineLoad(running=3, lora=LoRAInfo(max_lora=2)), 0.0, 0.0)
    assert p.is_adapter("math") and p.holders(DEFAULT_POOL, "math") == [A]
    assert p.not_serving(DEFAULT_POOL, "math") == frozenset({B})
    assert p.choose(_request("sql"), 0.0).url == A  # A runs it: no load, no slot wait
    views = {v.url: v for v in p.views(_request("tools"), [A, B], 0.0)}
    assert views[A].adapter_slots_full and not views[B].adapter_slots_full  # A's two slots run sql and chat
    assert views[A].adapter_missing and views[B].adapter_missing
    assert p.choose(_request("tools"), 0.0).url == B  # same load, same missing adapter: the free slot wins
    assert ADAPTER_SLOT_WAIT_COST_TOKENS < ADAPTER_LOAD_COST_TOKENS  # waiting for a slot beats loading elsewhere

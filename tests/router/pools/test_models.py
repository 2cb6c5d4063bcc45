"""Which pools serve which model, and what a request's model resolves to (router/pools/models.py): exact."""

from __future__ import annotations

import random

from router.pools.choice import PoolChoice, PoolSpec, choose_pool
from router.pools.models import ModelCatalog, catalog, resolve_model
from router.refusal import Refusal

SMALL = PoolSpec("small", "v1", 90, models=("smollm2",))
CANARY = PoolSpec("small-canary", "v2", 10, models=("smollm2",), canary=True)
LARGE = PoolSpec("large", "v1", 1, models=("llama-70b", "llama-70b-chat"))
LEARNED = PoolSpec("misc", "v1", 1)  # declares none: what its replicas list


def test_declared_and_learned_models():
    cat = catalog([SMALL, CANARY, LARGE, LEARNED], {"misc": frozenset({"qwen", "smollm2"}), "small": frozenset({"x"})})
    assert dict(cat.pools_of) == {"smollm2": ("small", "small-canary", "misc"), "llama-70b": ("large",),
                                  "llama-70b-chat": ("large",), "qwen": ("misc",)}
    assert cat.unlearned == ()  # a declared pool serves what it declares, whatever its replicas list ("x")


def test_a_declared_pool_also_serves_the_adapters_its_replicas_list():
    """vLLM or kvfleet replicas list their LoRA adapters with the base model as parent: a pool declaring the base
    model serves them (what they list that is not an adapter, "x", stays out)."""
    cat = catalog([SMALL, LARGE], {"small": frozenset({"smollm2", "sql", "x"})}, {"small": frozenset({"sql"})})
    assert dict(cat.pools_of) == {"smollm2": ("small",), "sql": ("small",), "llama-70b": ("large",),
                                  "llama-70b-chat": ("large",)}
    assert resolve_model("sql", None, None, cat) == ("sql", ("small",))


def test_a_pool_no_replica_has_answered_for_is_unlearned():
    cat = catalog([SMALL, LEARNED], {})
    assert dict(cat.pools_of) == {"smollm2": ("small",)} and cat.unlearned == ("misc",)


def _refusal(got) -> tuple:
    assert isinstance(got, Refusal), got
    return got.status, got.body["error"]["code"], got.body["error"]["param"]


def test_resolution():
    cat = catalog([SMALL, CANARY, LARGE], {})
    assert resolve_model("llama-70b", None, None, cat) == ("llama-70b", ("large",))
    assert resolve_model(None, "smollm2", None, cat) == ("smollm2", ("small", "small-canary"))
    assert _refusal(resolve_model(None, None, None, cat)) == (400, "missing_required_parameter", "model")
    unknown = resolve_model("gpt-5", None, None, cat)
    assert _refusal(unknown) == (404, "model_not_found", "model")
    assert unknown.body["error"]["message"] == "The model `gpt-5` does not exist or you do not have access to it."
    # a tenant limited to smollm2 gets the very same answer for a model that exists
    denied = resolve_model("llama-70b", None, frozenset({"smollm2"}), cat)
    assert denied.body == resolve_model("llama-70b", None, None, ModelCatalog({})).body
    assert denied.status == 404
    assert resolve_model("smollm2", None, frozenset({"smollm2"}), cat)[0] == "smollm2"


def test_an_unknown_model_waits_while_a_pool_is_unlearned():
    got = resolve_model("qwen", None, None, catalog([SMALL, LEARNED], {}))
    assert _refusal(got) == (503, "no_ready_replica", None) and (b"retry-after", b"1") in got.headers
    assert resolve_model("qwen", None, None, catalog([SMALL, LEARNED], {"misc": frozenset({"qwen"})}))[1] == ("misc",)


def test_weights_and_canaries_work_per_model():
    """Sessions of smollm2 split 90/10 between its pool and canary; llama-70b's all go to its own pool."""
    cat = catalog([SMALL, CANARY, LARGE], {})
    by_name = {p.name: p for p in (SMALL, CANARY, LARGE)}
    counts = {"small": 0, "small-canary": 0}
    for i in range(2000):
        pools = [by_name[n] for n in cat.pools_of["smollm2"]]
        got = choose_pool(pools, f"s{i}", 10, 8, 0, random.Random(0))
        assert isinstance(got, PoolChoice)
        counts[got.pool.name] += 1
    assert 0.08 < counts["small-canary"] / 2000 < 0.12
    large = [by_name[n] for n in cat.pools_of["llama-70b"]]
    assert {choose_pool(large, f"s{i}", 10, 8, 0, random.Random(0)).pool.name for i in range(50)} == {"large"}

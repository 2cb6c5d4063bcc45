"""What the router's /v1/models lists of its replicas' listings (router/http/models.py's listed_models): exact."""

from __future__ import annotations

from router.http.models import listed_models
from router.pools.choice import PoolSpec

SMALL = PoolSpec("small", "v1", 1, models=("smollm2",), adapters=(("cold", "/adapters/cold"),))
THIRD = PoolSpec("third", "v1", 1, models=("llama",))


def entry(model: str, parent: str | None = None) -> dict:
    return {"id": model, "object": "model", "owned_by": "vllm", "parent": parent}


def test_served_models_their_adapters_and_on_demand_adapters():
    served = {"smollm2": ("small",), "cold": ("small",), "sql": ("small",), "llama": ("third",)}
    listing = [entry("smollm2"), entry("sql", "smollm2"), entry("other"), entry("stray", "other")]
    got = listed_models(listing, served, {"small": SMALL, "third": THIRD}, lambda pools: pools == ("third",))
    assert got == [entry("smollm2"), entry("sql", "smollm2"),  # what the replicas list, adapters with a parent
                   {"id": "llama", "object": "model", "created": 0, "owned_by": "kvfleet"},  # declared, unlisted
                   {"id": "cold", "object": "model", "created": 0, "owned_by": "kvfleet", "parent": "smollm2"}]
    got = listed_models([], served, {"small": SMALL, "third": THIRD}, lambda pools: False)
    assert [m["id"] for m in got] == ["cold"]  # no ready replica: only what a pool can load on demand

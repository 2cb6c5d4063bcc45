"""LoRA adapters in the chart: a pool's `lora` gives its kvfleet (or vLLM) engines --enable-lora, --max-loras,
--max-lora-rank, --max-cpu-loras and --lora-modules; the router's pools file lists the adapters as the pool's
models, or, with routerOnDemand, as `adapters:` the routers load on demand (and the engines start without them).
The router's own parser loads what is rendered."""

from __future__ import annotations

import yaml

from router.pools.file import parse_pools
from tests.helm.chart import container, engine, pools_file, render

LORA = {"enabled": True, "modules": {"sql": "/models/adapters/sql", "chat": "/models/adapters/chat"},
        "maxLoras": 4, "maxLoraRank": 64, "maxCpuLoras": 8}


def _args(r) -> list[str]:
    return container(engine(r, "stable"), "engine")["args"]


def test_engines_get_the_lora_flags_and_the_router_the_adapter_names():
    r = render({"engineDefaults": {"lora": LORA}})
    args = _args(r)
    i = args.index("--lora-modules")
    assert {"--enable-lora", "--max-loras=4", "--max-lora-rank=64", "--max-cpu-loras=8"} <= set(args)
    assert args[i + 1:i + 3] == ["chat=/models/adapters/chat", "sql=/models/adapters/sql"]
    doc = pools_file(r)
    assert doc["pools"]["stable"]["models"] == ["smollm2", "chat", "sql"] and "model" not in doc["pools"]["stable"]
    cfg = parse_pools(yaml.safe_dump(doc), "pools.yaml")
    assert cfg.pools[0].spec.models == ("smollm2", "chat", "sql")


def test_router_on_demand_loading():
    r = render({"engineDefaults": {"lora": {**LORA, "routerOnDemand": True}}})
    args = _args(r)
    assert "--enable-lora" in args and "--lora-modules" not in args
    doc = pools_file(r)
    assert doc["pools"]["stable"]["adapters"] == LORA["modules"] and doc["pools"]["stable"]["model"] == "smollm2"
    spec = parse_pools(yaml.safe_dump(doc), "pools.yaml").pools[0].spec
    assert dict(spec.adapters) == LORA["modules"]


def test_lora_is_off_by_default():
    r = render({})
    assert not any("lora" in a for a in _args(r))
    assert "adapters" not in pools_file(r)["pools"]["stable"]

"""LoRA adapters through a real router in front of fake engines (loadtest/fake_engine.py) that list, load and
serve adapters as kvfleet's engines do (names only): requests by adapter name with the official `openai`
client; replicas that do not hold an adapter never get its requests; with on-demand loading (the pool's
`adapters:`) a cold adapter costs one load on one replica, and adapter + prefix affinity in one score, measured
on two replicas with 8 adapters of zipf popularity, against round-robin: loads triggered, share of requests on
a replica that already held their adapter, prefix hit rate."""

from __future__ import annotations

import random

import httpx
import openai
import pytest

from tests.router.conftest import fake_engine, metric, router, wait_for

ADAPTERS = [f"a{i}" for i in range(8)]
POOLS = """
pools:
  p:
    version: v1
    weight: 1
    model: smollm2
{adapters}    replicas: [{r1}, {r2}]
"""


def _fleet(procs, tmp_path, policy: str, on_demand: bool, *fake_args: list[str]):
    fakes = [fake_engine(procs, f"f{i}", "--chunks", "2", *(fake_args[i] if i < len(fake_args) else []))
             for i in range(2)]
    for f in fakes:
        f.wait_ready()
    adapters = ("    adapters:\n" + "".join(f"      {a}: /adapters/{a}\n" for a in ADAPTERS)) if on_demand else \
        "    models: [smollm2, a0, a1, a2]\n"
    text = POOLS.format(adapters=adapters, r1=fakes[0].url, r2=fakes[1].url)
    if not on_demand:
        text = text.replace("    model: smollm2\n", "")
    path = tmp_path / f"pools-{policy}.yaml"
    path.write_text(text)
    rt = router(procs, None, "--pools", str(path), policy=policy).wait_ready()
    wait_for(lambda: httpx.get(rt.url + "/ready").json()["ready_replicas"] == 2, what="2 replicas")
    return rt, fakes


def _stats(fake) -> dict:
    return httpx.get(fake.url + "/fake/stats", timeout=10).json()


def test_requests_by_adapter_go_to_replicas_that_hold_it(procs, tmp_path):
    rt, (f1, f2) = _fleet(procs, tmp_path, "kv", False, ["--lora-modules", "a0", "a1"], ["--lora-modules", "a2"])
    wait_for(lambda: httpx.post(rt.url + "/v1/completions", json={"model": "a2", "prompt": [1, 2, 3]},
                                timeout=10).status_code == 200, what="the router learned the adapters")
    with openai.OpenAI(base_url=rt.url + "/v1", api_key="unused", max_retries=0, timeout=30) as client:
        for model in ("a0", "a1", "a2", "a0", "a2"):
            assert client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=2).choices[0].text
            chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=2, stream=True))
            assert chunks
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="a7", prompt=[5, 6, 7], max_tokens=2)
    assert set(_stats(f1)["lora_by_adapter"]) == {"a0", "a1"}  # never a2's requests
    assert set(_stats(f2)["lora_by_adapter"]) == {"a2"}


def _zipf_trace(n: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    """(adapter, prompt): adapter by zipf popularity (s = 1.1); each adapter's 48-token system prompt, then a
    16-token question."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** 1.1 for k in range(len(ADAPTERS))]
    out = []
    for _ in range(n):
        k = rng.choices(range(len(ADAPTERS)), weights)[0]
        system = [1000 + 64 * k + j for j in range(48)]
        out.append((ADAPTERS[k], system + [rng.randrange(5000, 9000) for _ in range(16)]))
    return out


def _measure(procs, tmp_path, policy: str) -> dict:
    rt, fakes = _fleet(procs, tmp_path, policy, True)
    listed = {m["id"]: m.get("parent") for m in httpx.get(rt.url + "/v1/models", timeout=10).json()["data"]}
    assert all(listed.get(a) == "smollm2" for a in ADAPTERS), listed  # on-demand adapters listed before any load
    trace = _zipf_trace(160)
    for adapter, prompt in trace:
        r = httpx.post(rt.url + "/v1/completions", json={"model": adapter, "prompt": prompt, "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200, r.text
    stats = [_stats(f) for f in fakes]
    loads = sum(s["lora_loads"] for s in stats)
    text = httpx.get(rt.url + "/metrics", timeout=10).text
    assert metric(text, "kvfleet_router_adapter_loads_total", pool="p", outcome="loaded") == loads
    served = sum(s["lora_requests"] for s in stats)
    return {"policy": policy, "loads": loads, "requests": served,
            "held_share": (served - loads) / served,  # every other request found its adapter already there
            "hit_rate": sum(s["prefix_hits"] for s in stats) / sum(s["prefix_queries"] for s in stats),
            "replicas_per_adapter": sum(len(s["lora_by_adapter"]) for s in stats) / len(ADAPTERS)}


@pytest.mark.slow  # a comparison run of ~16 s; adapter placement is tested exactly beside it
def test_adapter_affinity_with_on_demand_loading_against_round_robin(procs, tmp_path):
    kv = _measure(procs, tmp_path, "kv")
    rr = _measure(procs, tmp_path, "round-robin")
    print(f"\nLoRA affinity, 2 replicas, 8 adapters (zipf 1.1), 160 requests:\n  kv:          {kv}\n  round-robin: {rr}")
    assert kv["requests"] == rr["requests"] == 160
    assert kv["loads"] == len(ADAPTERS)  # each adapter loaded once, on one replica: a cold adapter costs one load
    assert kv["replicas_per_adapter"] == 1.0
    assert rr["loads"] > kv["loads"] and kv["held_share"] > rr["held_share"]
    assert kv["hit_rate"] > rr["hit_rate"]

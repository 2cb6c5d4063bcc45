"""One router in front of two unmodified vLLM-CPU engines started with --enable-lora: requests for an adapter one
engine holds go to it; a cold adapter named in the pool's `adapters:` is loaded once, on one engine, through
vLLM's own /v1/load_lora_adapter (VLLM_ALLOW_RUNTIME_LORA_UPDATING), and its next requests follow it there; the
router reads vLLM's `vllm:lora_requests_info` (the adapters an engine is running, its max_lora). Slow: vLLM starts
in minutes. vLLM comes from the peers folder (kvfleet/peers.py, KVFLEET_PEERS_DIR).

    pytest -m slow tests/router/test_vllm_lora.py -s
"""

from __future__ import annotations

import threading

import httpx
import pytest

from kvfleet.peers import peers_dir, vllm_model_dir, vllm_python
from loadtest.vllm_fleet import start_vllm
from router.routing.replicas import parse_engine_metrics
from tests.engine.lora._adapters import write_adapter
from tests.router.conftest import metric, router, wait_for

pytestmark = pytest.mark.slow

LORA = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--max-cpu-loras", "4")


def ask(url: str, model: str) -> str:
    """The replica that served one chat request for `model` through the router."""
    r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "model": model, "messages": [{"role": "user", "content": "Write a SQL query."}], "max_tokens": 8,
        "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    return r.headers["x-kvfleet-replica"]


def test_adapters_on_vllm_engines_route_load_on_demand_and_report_running(procs, tmp_path):
    peers = peers_dir()
    hf = vllm_model_dir(peers, "bfloat16")
    if not (vllm_python(peers).exists() and (hf / "config.json").exists()):
        pytest.skip(f"vLLM-CPU is not installed in {peers} (vllm-venv/, smollm2-hf-bf16/; set KVFLEET_PEERS_DIR, or "
                    "run python -m loadtest.vllm_fleet --install)")
    sql = write_adapter(str(tmp_path / "sql"), 8, ("q_proj", "v_proj"), seed=1)
    cold = write_adapter(str(tmp_path / "cold"), 16, ("q_proj", "k_proj", "v_proj", "o_proj"), seed=2)
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    engines = [start_vllm(peers, str(tmp_path), "vllm-0", "0", "bfloat16", 32,
                          (*LORA, "--lora-modules", f"sql={sql}"), env)[0],
               start_vllm(peers, str(tmp_path), "vllm-1", "1", "bfloat16", 32, LORA, env)[0]]
    try:
        for e in engines:
            e.wait_ready(timeout=900, path="/health")
        pools = tmp_path / "pools.yaml"
        pools.write_text(f"pools:\n  p:\n    version: v1\n    weight: 1\n    model: smollm2\n    engine: vllm\n"
                         f"    tokenizer: {hf}\n    adapters:\n      cold: {cold}\n"
                         f"    replicas: [{engines[0].url}, {engines[1].url}]\n")
        rt = router(procs, None, "--pools", str(pools)).wait_ready()
        wait_for(lambda: {m["id"] for m in httpx.get(rt.url + "/v1/models").json()["data"]} >= {"smollm2", "sql"},
                 timeout=30, what="the router lists vLLM's adapter")
        assert {ask(rt.url, "sql") for _ in range(4)} == {engines[0].url}  # only engine 0 holds it

        first = ask(rt.url, "cold")  # loaded on demand on one engine, then followed there
        assert {ask(rt.url, "cold") for _ in range(3)} == {first}
        assert "cold" in {m["id"] for m in httpx.get(first + "/v1/models").json()["data"]}
        assert metric(httpx.get(rt.url + "/metrics").text, "kvfleet_router_adapter_loads_total", outcome="loaded") == 1

        # a long request under `sql` running on engine 0: vLLM's gauge names it, with its max_lora
        body = {"model": "sql", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
        long = threading.Thread(target=lambda: httpx.post(engines[0].url + "/v1/completions", json=body, timeout=300))
        long.start()
        seen = []

        def running() -> bool:
            lora = parse_engine_metrics(httpx.get(engines[0].url + "/metrics").text).lora
            if lora is not None and "sql" in lora.running:
                seen.append(lora)
            return bool(seen) or not long.is_alive()

        wait_for(running, timeout=120, interval=0.2, what="sql among vLLM's running adapters")
        long.join(timeout=300)
        assert seen and seen[0].max_lora == 2
    finally:
        for e in engines:
            e.stop()
